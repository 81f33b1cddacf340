"""The fusion rerank mode: query likelihood and the embedder's cosine in one request, in the same steps; its
arithmetic by hand, its scores against transformers (likelihood) and sentence-transformers (vectors)."""
import math

import pytest

from engine import LLM, EngineConfig, RerankParams, SamplingParams
from engine.config import EMBEDDED_EMBEDDER
from engine.embed.embedder import embedded_embedder_dir
from engine.rerank.fusion import convex, minmax, rrf
from engine.request import SeqKind
from tests.engine.conftest import assert_no_leaks, record_steps
from tests.engine.test_rerank_llm import DOCS, QUERY, _hf_mean_logprob


@pytest.fixture(scope="module")
def fusion_llm() -> LLM:
    """The embedded LLM with the embedded embedder, as `tandem serve --rerank-mode fusion` starts."""
    return LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="fusion", max_num_batched_tokens=256))


def test_fusion_arithmetic_by_hand():
    assert minmax([2.0, 4.0, 3.0]) == [0.0, 1.0, 0.5]
    assert minmax([7.0, 7.0]) == [0.5, 0.5]  # nothing to tell apart: the other signal decides
    # likelihood orders 0 > 1 > 2, the cosine 2 > 1 > 0; equal weights tie the ends, the middle stays the middle
    assert convex([0.9, 0.5, 0.1], [0.1, 0.2, 0.3]) == pytest.approx([0.5, 0.5, 0.5])
    assert convex([0.9, 0.5, 0.1], [0.1, 0.2, 0.3], weight=1.0) == pytest.approx([1.0, 0.5, 0.0])
    assert convex([0.2, 0.6], [0.5, 0.1]) == pytest.approx([0.5, 0.5])
    assert convex([0.2, 0.6, 0.4], [0.5, 0.1, 0.3]) == pytest.approx([0.5, 0.5, 0.5])
    assert rrf([3.0, 1.0], [3.0, 1.0], k=0) == [2.0, 1.0]  # rank 1 in both, rank 2 in both
    assert rrf([1.0, 3.0], [3.0, 1.0], k=60) == pytest.approx([1 / 62 + 1 / 61, 1 / 61 + 1 / 62])


def test_fusion_is_transformers_likelihood_fused_with_sentence_transformers_cosine(
        fusion_llm, hf_model):
    from sentence_transformers import SentenceTransformer

    eng = fusion_llm.engine
    assert eng.scorer.mode == "fusion" and eng.model_info()["rerank_mode"] == "fusion"
    records = record_steps(fusion_llm)
    scores = fusion_llm.rerank(QUERY, DOCS)
    pairs, _ = eng.scorer.pairs(QUERY, DOCS, RerankParams(), 10**6)
    likelihood = [math.exp(_hf_mean_logprob(hf_model, p.token_ids, p.logprob_start)) for p in pairs]
    st = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    q, *d = st.encode([QUERY, *DOCS], normalize_embeddings=True)
    cosine = [float(q @ v) for v in d]
    want = convex(likelihood, cosine)
    assert scores == pytest.approx(want, abs=2e-3)
    assert sorted(range(len(DOCS)), key=lambda i: -scores[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])
    # the query and every document rode the scheduler's steps as embedder rows, beside the pairs
    assert sum(r.embed_rows_done for r in records) == 1 + len(DOCS)
    assert sum(r.rerank_pairs_scored for r in records) == len(DOCS)
    assert_no_leaks(fusion_llm)


def test_fusion_shares_steps_with_a_generation_and_one_document_scores_one_half(fusion_llm):
    eng = fusion_llm.engine
    records = record_steps(fusion_llm)
    eng.add_request("g", "Tell me about bees.", SamplingParams(max_tokens=12, ignore_eos=True))
    outs = eng.step()  # the prompt's prefill: the generation decodes from the next step on
    assert [o.request_id for o in outs] == ["g"]
    eng.add_rerank("r", QUERY, DOCS[:1])
    while eng.has_unfinished():
        outs.extend(eng.step())
    final = [o for o in outs if o.request_id == "r"]
    assert [o.scores for o in final] == [[0.5]]  # one document: both scaled signals are 0.5
    assert any(r.embed_rows and r.decode_tokens for r in records)  # an embedder row beside a decode
    assert_no_leaks(fusion_llm)


def test_an_aborted_fusion_rerank_frees_its_pairs_and_rows(fusion_llm):
    eng = fusion_llm.engine
    eng.add_rerank("a", QUERY, DOCS * 4)
    job = eng._requests["a"]
    assert [s.kind for s in job.rows] == [SeqKind.EMBED] * (1 + 4 * len(DOCS))
    eng.step()
    assert eng.abort("a")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason, o.scores) for o in outs] == [("a", "abort", None)]
    assert not eng.has_unfinished()
    assert_no_leaks(fusion_llm)


def test_fusion_needs_an_embedder():
    with pytest.raises(ValueError, match="needs embedder"):
        EngineConfig(rerank_mode="fusion")
    assert EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="likelihood").rerank_mode == "likelihood"
