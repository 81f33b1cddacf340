"""LLM reranker recipes: how a causal LM trained as a reranker wants a (query, document) pair laid out and which
logits at its last position make the score. The judge rerank mode (engine/rerank/judge.py) runs one of them.

* ``qwen3``: the Qwen3-Reranker model card: its system prompt, "<Instruct>: ...\\n<Query>: ...\\n<Document>: doc",
  the suffix with the empty think block; score = softmax over the "no" / "yes" logits, P(yes).
* ``mxbai-v2``: mixedbread's mxbai-rerank-v2 (the `mxbai-rerank` library's MxbaiRerankV2): ChatML around
  "[instruction: ...\\n]query: ...", "\\n", "document: ...", "\\n" and its task prompt ending "Relevance:", each
  piece tokenized apart as the library does; the library's score is logit("1") - logit("0"), reported here as its
  sigmoid (the same order, in [0, 1]: softmax over {"0", "1"}).
* ``template``: any other model, from a template (`RerankTemplate`: a JSON file or text, `--rerank-template`):
  a text with {query}, {document} and optionally {instruction} slots and the tokens whose logits score, in vLLM's
  `classifier_from_token` convention: two tokens ["no", "yes"] score as softmax over them (P of the second), one
  token ["Yes"] as the sigmoid of its logit (bge-reranker-v2-gemma's normalised score).

Which recipe a model follows: `rerank_recipe` (tandem serve --rerank-recipe) when set; else a `rerank_template`
(--rerank-template); else what the model directory says (`recipe_from_dir`): a `rerank_template.json` in it, else
its name (the directory's path, config.json's `_name_or_path`, or README's `base_model`) containing "Qwen3-Reranker" or
"mxbai-rerank"; else qwen3 (the judge mode's recipe before recipes existed).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import RERANK_RECIPES, RerankRecipe
from engine.models import hub

TEMPLATE_FILE = "rerank_template.json"  # a model directory's own template, read when no flag names a recipe


RECIPES = RERANK_RECIPES

# The names that say a checkpoint's recipe (matched case-insensitively in its directory name, config.json's
# _name_or_path or README's base_model).
_NAMED = ((re.compile(r"qwen3[-_]?reranker", re.I), RerankRecipe.QWEN3),
          (re.compile(r"mxbai[-_]rerank[-_].*v2", re.I), RerankRecipe.MXBAI_V2))


@dataclass(frozen=True, slots=True)
class RerankTemplate:
    """A generic recipe: `template` has exactly one {document} slot, a {query} slot and optionally {instruction};
    `tokens` names the token(s) whose last-position logits score (see the module's docstring); `instruction` is the
    default for requests that send none; `add_special_tokens`: the text before the document is tokenized with the
    tokenizer's special tokens (a BOS for Gemma)."""
    template: str
    tokens: tuple[str, ...] = ("no", "yes")
    instruction: str = ""
    add_special_tokens: bool = False
    source: str = field(default="", compare=False)  # where it was read from, for messages

    def __post_init__(self) -> None:
        where = f" ({self.source})" if self.source else ""
        if not isinstance(self.template, str) or self.template.count("{document}") != 1:
            raise ValueError(f"rerank template{where}: 'template' must hold {{document}} exactly once")
        if "{query}" not in self.template:
            raise ValueError(f"rerank template{where}: 'template' must hold a {{query}} slot")
        try:
            self.template.format(query="", document="", instruction="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"rerank template{where}: only {{query}}, {{document}} and {{instruction}} slots are "
                             f"allowed (write a literal brace as {{{{ or }}}}): {exc}") from None
        if not 1 <= len(self.tokens) <= 2 or not all(isinstance(t, str) and t for t in self.tokens):
            raise ValueError(f"rerank template{where}: 'classifier_from_token' must name one token (its logit's "
                             "sigmoid scores) or two, [negative, positive] (softmax over them)")

    @classmethod
    def parse(cls, spec: str) -> "RerankTemplate":
        """A template from the path of a JSON file or from JSON text: {"template": ..., "classifier_from_token":
        [...], "instruction": ..., "add_special_tokens": ...}."""
        source = "the --rerank-template text"
        text = spec
        if not spec.lstrip().startswith("{"):
            if not os.path.isfile(spec):
                raise ValueError(f"rerank template {spec!r} is neither a JSON object nor a file")
            source, text = spec, Path(spec).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"rerank template ({source}) is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"rerank template ({source}) must be a JSON object")
        unknown = set(data) - {"template", "classifier_from_token", "instruction", "add_special_tokens"}
        if unknown:
            raise ValueError(f"rerank template ({source}): unknown keys {sorted(unknown)}")
        tokens = data.get("classifier_from_token", ["no", "yes"])
        if not isinstance(tokens, list):
            raise ValueError(f"rerank template ({source}): 'classifier_from_token' must be a list of token strings")
        return cls(data.get("template"), tuple(tokens), data.get("instruction") or "",
                   bool(data.get("add_special_tokens", False)), source=source)


def _names(model_dir: Path) -> list[str]:
    """What a model directory says it is: its path (a Hugging Face cache's snapshot sits under
    models--ORG--NAME), config.json's _name_or_path, the list items and base_model of README's front matter."""
    names = [str(model_dir.resolve())]
    try:
        names.append(str(json.loads((model_dir / "config.json").read_text()).get("_name_or_path", "")))
    except (OSError, ValueError):
        pass
    try:
        readme = (model_dir / "README.md").read_text(encoding="utf-8", errors="replace")
    except OSError:
        readme = ""
    head = readme.split("\n---", 1)[0] if readme.startswith("---") else ""  # the model card's YAML front matter
    names += re.findall(r"^\s*(?:-\s*|base_model:\s*)([\w./-]+)\s*$", head, re.M)
    return names


def recipe_from_dir(model: str | None) -> RerankRecipe | None:
    """The recipe a model directory declares (see the module's docstring), or None: it says none."""
    if not model:
        return None
    if not os.path.isdir(model):  # a Hub id's name says its recipe (read before anything is fetched)
        ref = hub.parse(model)
        names = [ref.repo_id] if ref else []
    elif (Path(model) / TEMPLATE_FILE).is_file():
        return RerankRecipe.TEMPLATE
    else:
        names = _names(Path(model))
    for name in names:
        for pattern, recipe in _NAMED:
            if pattern.search(name):
                return recipe
    return None


def resolve(recipe: RerankRecipe | str | None, template: str | None, model: str | None
            ) -> tuple[RerankRecipe, RerankTemplate | None]:
    """The recipe to run and, for the template recipe, its template: the flags first, then the model directory's
    word, then qwen3."""
    if recipe is not None:
        recipe = RerankRecipe(recipe)
    else:
        recipe = RerankRecipe.TEMPLATE if template else recipe_from_dir(model) or RerankRecipe.QWEN3
    if recipe is not RerankRecipe.TEMPLATE:
        if template:
            raise ValueError(f"rerank_template is given but rerank_recipe is {recipe.value!r}: a template is the "
                             "'template' recipe (leave rerank_recipe unset)")
        return recipe, None
    if template:
        return recipe, RerankTemplate.parse(template)
    found = Path(model) / TEMPLATE_FILE if model and os.path.isdir(model) else None
    if found is None or not found.is_file():
        raise ValueError("the 'template' rerank recipe needs a template: rerank_template=FILE|JSON (tandem serve "
                         f"--rerank-template) or a {TEMPLATE_FILE} in the model directory")
    return recipe, RerankTemplate.parse(str(found))
