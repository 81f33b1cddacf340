"""Reranking in one place: a rerank mode (PairScorer) turns (query, document) pairs into tokens and their forward
into scores; RerankJob tracks one request's pairs. The scheduler sees pairs only as prefill-only sequences."""
from __future__ import annotations

from engine.config import EngineConfig, RerankMode
from engine.rerank.job import RerankJob
from engine.rerank.pairs import PairTemplate, PairTokens
from engine.rerank.scorer import PairScorer
from engine.settings import Settings

# The default mode for a causal LM: query likelihood measured best on the retrieval-quality benchmark
# (bench/rerank_quality.py; figures in docs/benchmarks.md "Rerank quality").
DEFAULT_LLM_MODE = RerankMode.LIKELIHOOD

__all__ = ["PairScorer", "PairTemplate", "PairTokens", "RerankJob", "build_scorer", "DEFAULT_LLM_MODE"]


def build_scorer(config: EngineConfig, tokenizer, model, settings: Settings) -> PairScorer:
    """The rerank mode `config` asks for (rerank_mode, or the default for what is loaded); `settings`: where the
    embedded model is cached, which attention backend a cross-encoder runs."""
    mode = config.rerank_mode or (RerankMode.CROSS_ENCODER if config.reranker else DEFAULT_LLM_MODE)
    if mode is RerankMode.CROSS_ENCODER:
        from engine.models.encoder_loader import CrossEncoder
        from engine.models.loader import resolve_model_dir
        from engine.rerank.cross_encoder import CrossEncoderScorer

        encoder = CrossEncoder.from_pretrained(resolve_model_dir(config.reranker, settings.cache_dir), config.device,
                                               config.dtype, settings.kernels)
        return CrossEncoderScorer(encoder)
    if mode is RerankMode.JUDGE:
        from engine.rerank.judge import JudgeScorer

        return JudgeScorer(tokenizer, model)
    from engine.rerank.likelihood import LikelihoodScorer

    return LikelihoodScorer(tokenizer)
