"""Yes/no judge: the pair is rendered into a relevance question by an LLM reranker's recipe (engine/rerank/recipes.py:
qwen3, mxbai-v2 or a template); the score is read off the recipe's token logits at the last position (qwen3:
P(yes) / (P(yes) + P(no)), right for checkpoints trained for it).

With a ChatML tokenizer (one that has `<|im_start|>`, as every Qwen3-Reranker does) the pair is laid out exactly as
the Qwen3-Reranker model card builds it: its literal system prefix, "<Instruct>: ...\n<Query>: ...\n<Document>: doc",
and its suffix with the empty think block; the document is tokenized with its leading space, so the ids equal the
card's tokenization of the whole "<Instruct>...<Document>: doc" string wherever a pre-token boundary falls after
"<Document>:" (a document that starts with a letter, digit or punctuation). Other tokenizers render the same
messages through their own chat template."""
from __future__ import annotations

import torch

from engine.config import RerankMode, RerankParams
from engine.rerank.pairs import DOC_SLOT, PairTemplate, split_chat
from engine.rerank.recipes import RerankRecipe, RerankTemplate
from engine.rerank.scorer import PairScorer
from engine.request import Sequence

JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# The Qwen3-Reranker model card's literal prefix and suffix around "<Instruct>: ...<Document>: doc".
CARD_PREFIX = f"<|im_start|>system\n{JUDGE_SYSTEM}<|im_end|>\n<|im_start|>user\n"
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
# The mxbai-rerank library's MxbaiRerankV2 (mxbai_rerank/mxbai_rerank_v2.py): its pieces, each tokenized apart.
MXBAI_SEP = "\n"
MXBAI_TASK = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
              "query-document pair, carefully analyze the semantic relationship between them, then provide your "
              "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
MXBAI_PREFIX = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\n")
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Per recipe: the tokens whose last-position logits score, [negative, positive].
RECIPE_TOKENS = {RerankRecipe.QWEN3: ("no", "yes"), RerankRecipe.MXBAI_V2: ("0", "1")}


def single_token(tokenizer, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer splits {word!r} into {len(ids)} tokens; the judge mode needs one")
    return ids[0]


class JudgeScorer(PairScorer):
    mode = RerankMode.JUDGE

    def __init__(self, tokenizer, model, recipe: RerankRecipe = RerankRecipe.QWEN3,
                 rerank_template: RerankTemplate | None = None) -> None:
        if (recipe is RerankRecipe.TEMPLATE) != (rerank_template is not None):
            raise ValueError("the template recipe, and only it, takes a rerank template")
        self.tokenizer = tokenizer
        self.recipe = recipe
        self.rerank_template = rerank_template
        tokens = rerank_template.tokens if rerank_template is not None else RECIPE_TOKENS[recipe]
        self.token_ids = [single_token(tokenizer, t) for t in tokens]
        self._rows = model.lm_head_rows(self.token_ids)  # the LM-head rows the score needs
        im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        chatml = im_start is not None and im_start != tokenizer.unk_token_id
        self.card_layout = chatml and recipe is RerankRecipe.QWEN3
        if recipe is RerankRecipe.MXBAI_V2 and not chatml:
            raise ValueError("the mxbai-v2 rerank recipe needs a ChatML tokenizer (<|im_start|>), as mxbai-rerank-v2's")
        # A document goes in with the space before it when its recipe's text has "...: " before the document: a
        # space-prefixed word is one pre-token, so the ids equal the whole text's tokenization there.
        if rerank_template is not None:
            self._lead = rerank_template.template.split("{document}")[0].endswith(" ")
        else:
            self._lead = self.card_layout or recipe is RerankRecipe.MXBAI_V2

    @property
    def yes_id(self) -> int:
        return self.token_ids[-1]

    @property
    def no_id(self) -> int:
        return self.token_ids[0]

    def template(self, query: str, params: RerankParams) -> PairTemplate:
        if self.recipe is RerankRecipe.MXBAI_V2:
            return self._mxbai(query, params.instruction)
        if self.rerank_template is not None:
            return self._generic(query, params.instruction)
        instruct = f"<Instruct>: {params.instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>:"
        if self.card_layout:
            enc = self._encode
            return PairTemplate(enc(CARD_PREFIX) + enc(instruct), enc(CARD_SUFFIX))
        messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": f"{instruct} {DOC_SLOT}"}]
        return PairTemplate(*split_chat(self.tokenizer, messages, add_generation_prompt=True))

    def _mxbai(self, query: str, instruction: str | None) -> PairTemplate:
        """MxbaiRerankV2.prepare_inputs: chat prefix + [instruction: I + sep] query: Q + sep + document: D + sep +
        task prompt + chat suffix, each piece tokenized apart."""
        enc = self._encode
        query_prompt = f"query: {query}"
        if instruction:
            query_prompt = f"instruction: {instruction}{MXBAI_SEP}{query_prompt}"
        sep = enc(MXBAI_SEP)
        return PairTemplate(enc(MXBAI_PREFIX) + enc(query_prompt) + sep + enc("document:"),
                            sep + enc(MXBAI_TASK) + enc(MXBAI_SUFFIX))

    def _generic(self, query: str, instruction: str | None) -> PairTemplate:
        t = self.rerank_template
        text = t.template.format(query="\x01QUERY\x01", instruction="\x01INSTRUCTION\x01", document=DOC_SLOT)
        text = text.replace("\x01QUERY\x01", query).replace("\x01INSTRUCTION\x01", instruction or t.instruction)
        before, after = text.split(DOC_SLOT)
        if self._lead:
            before = before[:-1]
        return PairTemplate(list(self.tokenizer(before, add_special_tokens=t.add_special_tokens).input_ids),
                            self._encode(after))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        texts = [" " + d for d in documents] if self._lead else documents
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        logits = (last_hidden @ self._rows.T).float()
        if logits.shape[-1] == 1:  # one token: its logit's sigmoid (e.g. bge-reranker-v2-gemma's "Yes")
            return logits[:, 0].sigmoid().tolist()
        return logits.softmax(dim=-1)[:, 1].tolist()  # [negative, positive]: P(positive)
