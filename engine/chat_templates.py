"""Chat templates that ship with tandem (engine/templates/*.jinja), selectable by name, and the end-of-turn tokens a
template closes a turn with.

`--chat-template gemma` (or llama3, chatml / qwen, mistral) gives a base model, or a GGUF file without a template,
its family's chat format; a path or a Jinja text works as before. A template closes each turn with a token the
model's EOS may not be (Gemma 3's GGUF declares EOS 1, `<eos>`, and closes a turn with `<end_of_turn>`, 106): like
llama.cpp's end-of-generation tokens, a chat stops at the template's end-of-turn token as at EOS.
"""
from __future__ import annotations

import enum
from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent / "templates"


class ChatTemplate(str, enum.Enum):
    """The templates that ship, by the name `--chat-template` takes (its file is engine/templates/<name>.jinja)."""
    GEMMA = "gemma"  # Gemma 2 / 3: <start_of_turn>user ... <end_of_turn>
    LLAMA3 = "llama3"  # Llama 3.x: <|start_header_id|>role<|end_header_id|> ... <|eot_id|>
    CHATML = "chatml"  # Qwen 2 / 2.5 / 3, SmolLM2: <|im_start|>role ... <|im_end|>
    MISTRAL = "mistral"  # Mistral / Mixtral instruct: [INST] ... [/INST] answer</s>

    @property
    def path(self) -> Path:
        return TEMPLATES_DIR / f"{self.value}.jinja"

    def __str__(self) -> str:
        return self.value


ALIASES = {"qwen": ChatTemplate.CHATML, "gemma3": ChatTemplate.GEMMA, "llama": ChatTemplate.LLAMA3}

# The template for each model_type (config.json; a GGUF's general.architecture as transformers maps it), suggested
# at start-up when a model has none.
FAMILY_OF_MODEL_TYPE = {"gemma": ChatTemplate.GEMMA, "gemma2": ChatTemplate.GEMMA, "gemma3": ChatTemplate.GEMMA,
                        "gemma3_text": ChatTemplate.GEMMA, "llama": ChatTemplate.LLAMA3,
                        "qwen2": ChatTemplate.CHATML, "qwen3": ChatTemplate.CHATML,
                        "mistral": ChatTemplate.MISTRAL}

# Tokens that close a turn in the chat formats tandem knows (llama.cpp's end-of-generation list, the ones a template
# writes): a chat stops at any of them that its template contains and the vocabulary has as one token.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>", "</s>",
                      "<|endoftext|>", "<end_of_utterance>")


def names() -> list[str]:
    return [t.value for t in ChatTemplate]


def template_text(given: str) -> str:
    """The Jinja text `--chat-template` names: a shipped template's name (or alias), a file's path, or the template
    itself. ValueError naming the choices when it is none of them."""
    key = given.strip().lower()
    if key in names() or key in ALIASES:
        return (ALIASES.get(key) or ChatTemplate(key)).path.read_text()
    path = Path(given).expanduser()
    text = path.read_text() if "{" not in given and path.is_file() else given
    if "{" not in text:
        raise ValueError(f"chat_template {given!r} is neither a shipped template ({', '.join(names())}), a file, "
                         "nor a Jinja template (--chat-template)")
    return text


def suggestion(model_type: str | None) -> str:
    """What to pass for a model without a chat template: its family's shipped template when known, else the list."""
    family = FAMILY_OF_MODEL_TYPE.get(model_type or "")
    choices = ", ".join(names())
    if family is not None:
        return f"--chat-template {family} (shipped: {choices}; or a Jinja file)"
    return f"--chat-template NAME ({choices}) or a Jinja file"


def end_of_turn_ids(tokenizer, template: str | None) -> list[int]:
    """The ids of the END_OF_TURN_TOKENS that `template` writes and the tokenizer has as single tokens."""
    if not template:
        return []
    ids = []
    for token in END_OF_TURN_TOKENS:
        if token not in template:
            continue
        encoded = tokenizer.convert_tokens_to_ids(token)
        if isinstance(encoded, int) and encoded != tokenizer.unk_token_id and encoded not in ids:
            ids.append(encoded)
    return ids
