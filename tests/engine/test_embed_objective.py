"""Three kinds of work under the latency objective: chats decoding, a rerank job scored by the LLM and an embedding
job, through LLMEngine.step() with an injected step-time model (fixed coefficients: what is admitted does not depend
on this machine's speed). Embedding tokens are priced as their own kind, so they take their share of each step's
headroom beside the decodes and the pairs. No wall-clock asserts."""
from __future__ import annotations

import pytest

from engine import EmbedParams
from engine.admission import LatencyAdmission
from engine.config import EMBEDDED_EMBEDDER
from engine.step_time import LinearStepTime, StepShape
from tests.engine.conftest import assert_no_leaks, make_llm, record_steps, run_to_end, start_chats
from tests.engine.test_latency_objective import COEF, DOCS, GEN, CountingModel

EMBED_COEF = dict(COEF, embed_forward=0.002, embed_tokens=0.0001)
TEXTS = [f"Bees number {i} visit flowers for nectar and pollen, then fly back to the hive to make honey."
         for i in range(24)]


class EmbedCountingModel(CountingModel):
    def __init__(self) -> None:
        LinearStepTime.__init__(self, EMBED_COEF)
        self.observed = []


def test_chats_pairs_and_embeddings_share_steps_under_the_target():
    target = LinearStepTime(EMBED_COEF).predict(StepShape(decode_rows=4, llm_rerank_tokens=60, embed_tokens=100))
    model = EmbedCountingModel()
    # fusion: a rerank that is LLM pairs and embedder rows at once (the default with an embedder, dense, has no pairs)
    llm = make_llm(admission=LatencyAdmission(target, model=model), embedder=EMBEDDED_EMBEDDER,
                   max_num_batched_tokens=512, num_kv_blocks=512, rerank_mode="fusion")
    engine = llm.engine
    records = record_steps(llm)
    start_chats(engine, GEN)
    engine.add_rerank("job", "how do bees make honey", DOCS)
    engine.add_embed("emb", TEXTS)
    finished = run_to_end(engine)
    assert_no_leaks(llm)
    assert len(finished["emb"].embeddings) == len(TEXTS) and len(finished["job"].scores) == len(DOCS)
    decoding = [r for r in records if r.decode_tokens == 4]
    with_embed = [r for r in decoding if r.embed_rows]
    assert len(with_embed) >= 2 and max(r.embed_rows for r in with_embed) >= 2  # the headroom, not a floor
    assert any(r.embed_rows and r.rerank_tokens for r in decoding)  # all three kinds in one step
    for r in decoding:
        if r.rerank_tokens or r.embed_tokens:
            assert r.predicted_s == pytest.approx(model.predict(StepShape.of_record(r)))
            assert r.predicted_s <= target or (r.rerank_pairs <= 1 and not r.embed_rows), r
    # Embedding tokens reach the model as their own feature, with the record's own shape.
    computed = [r for r in records if r.num_seqs]
    assert model.observed == [(StepShape.of_record(r), r.duration_s) for r in computed]
    # ... the embedding request's rows and the fused rerank's (query and documents)
    fused_rows = engine.embedder.rows(["how do bees make honey", *DOCS], None, EmbedParams())
    assert sum(s.embed_tokens for s, _ in model.observed) == finished["emb"].prompt_tokens + sum(
        len(r.token_ids) for r in fused_rows)
