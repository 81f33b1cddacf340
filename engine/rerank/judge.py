"""Yes/no judge: the pair is rendered into a relevance question; score = P(yes) / (P(yes) + P(no)) at the last
position (the Qwen3-Reranker recipe, right for checkpoints trained for it).

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
from engine.rerank.scorer import PairScorer
from engine.request import Sequence

JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# The Qwen3-Reranker model card's literal prefix and suffix around "<Instruct>: ...<Document>: doc".
CARD_PREFIX = f"<|im_start|>system\n{JUDGE_SYSTEM}<|im_end|>\n<|im_start|>user\n"
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def single_token(tokenizer, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer splits {word!r} into {len(ids)} tokens; the judge mode needs one")
    return ids[0]


class JudgeScorer(PairScorer):
    mode = RerankMode.JUDGE

    def __init__(self, tokenizer, model) -> None:
        self.tokenizer = tokenizer
        self.yes_id = single_token(tokenizer, "yes")
        self.no_id = single_token(tokenizer, "no")
        self._yes_no = model.lm_head_rows([self.yes_id, self.no_id])  # the two LM-head rows the score needs
        im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.card_layout = im_start is not None and im_start != tokenizer.unk_token_id

    def template(self, query: str, params: RerankParams) -> PairTemplate:
        instruct = f"<Instruct>: {params.instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>:"
        if self.card_layout:
            enc = self._encode
            return PairTemplate(enc(CARD_PREFIX) + enc(instruct), enc(CARD_SUFFIX))
        messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": f"{instruct} {DOC_SLOT}"}]
        return PairTemplate(*split_chat(self.tokenizer, messages, add_generation_prompt=True))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        texts = [" " + d for d in documents] if self.card_layout else documents
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        logits = (last_hidden @ self._yes_no.T).float()
        return logits.softmax(dim=-1)[:, 0].tolist()
