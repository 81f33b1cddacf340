"""Cross-encoder mode: a BERT / RoBERTa / XLM-R sequence classifier scores packed pairs, no KV cache at all."""
from __future__ import annotations

import torch

from engine.config import RerankMode, RerankParams
from engine.models.encoder_loader import CrossEncoder
from engine.models.stages import Finish, StagedForward, StageResult, StageWork
from engine.rerank.pairs import PairTemplate
from engine.rerank.scorer import PairScorer
from engine.request import Sequence


class CrossEncoderScorer(PairScorer):
    mode = RerankMode.CROSS_ENCODER
    runs_on_llm = False

    def __init__(self, encoder: CrossEncoder) -> None:
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.max_length = encoder.max_length
        self._layout = _pair_layout(self.tokenizer)

    def template(self, query: str, params: RerankParams) -> PairTemplate:
        """What `tokenizer(query, document)` puts around the document: specials, the query, specials."""
        pre, pre_types, mid, mid_types, post, post_types, first_type, second_type = self._layout
        query_ids = list(self.tokenizer(query, add_special_tokens=False).input_ids)
        return PairTemplate(pre + query_ids + mid, post, prefix_types=pre_types + [first_type] * len(query_ids)
                            + mid_types, document_type=second_type, suffix_types=post_types)

    def document_ids(self, documents: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(documents, add_special_tokens=False).input_ids]

    def score(self, pairs: list[Sequence], last_hidden: torch.Tensor | None) -> list[float]:
        return self.encoder.score([(p.token_ids, p.pair.token_type_ids) for p in pairs])

    @property
    def stages(self) -> int:
        return self.encoder.stages

    def score_stages(self, pairs: list[Sequence], stages: list[tuple[int, int]], states: list[torch.Tensor | None]
                     ) -> list[StageResult]:
        return self.encoder.score_stages(_work(pairs, stages, states))

    @property
    def staged(self) -> StagedForward:
        return self.encoder.staged

    def stage_part(self, pairs: list[Sequence], stages: list[tuple[int, int]], states: list[torch.Tensor | None]
                   ) -> tuple[list[StageWork], Finish]:
        return self.encoder.stage_part(_work(pairs, stages, states))


def _work(pairs: list[Sequence], stages: list[tuple[int, int]], states: list[torch.Tensor | None]
          ) -> list[StageWork]:
    return [StageWork(p.token_ids, start, stop, p.pair.token_type_ids, state=state)
            for p, (start, stop), state in zip(pairs, stages, states)]


def _pair_layout(tokenizer):
    """The special tokens (and segment ids) a pair encoding puts before, between and after its two texts, read off
    one probe pair: (pre, pre_types, mid, mid_types, post, post_types, first_type, second_type)."""
    first, second = "first", "second"
    a = list(tokenizer(first, add_special_tokens=False).input_ids)
    b = list(tokenizer(second, add_special_tokens=False).input_ids)
    enc = tokenizer(first, second, return_token_type_ids=True)
    ids = list(enc["input_ids"])
    types = list(enc.get("token_type_ids") or [0] * len(ids))
    i = _find(ids, a, 0)
    j = _find(ids, b, i + len(a))
    if i < 0 or j < 0:
        raise ValueError("cannot read the pair layout of this tokenizer: a pair's tokens are not its texts' tokens")
    k = j + len(b)
    return (ids[:i], types[:i], ids[i + len(a):j], types[i + len(a):j], ids[k:], types[k:],
            types[i] if a else 0, types[j] if b else 0)


def _find(seq: list[int], part: list[int], start: int) -> int:
    for i in range(start, len(seq) - len(part) + 1):
        if seq[i:i + len(part)] == part:
            return i
    return -1
