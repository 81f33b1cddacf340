"""The dense and cascade rerank modes: dense is the embedder's own cosine ranking (sentence-transformers as the
reference) with no LLM pair; the cascade re-scores only the dense top k with the LLM (counted in the step records)
and keeps the rest in dense order; a request's work is shared (each text tokenized once, the query embedded once,
the rows packed into one step where the budget allows)."""
import math

import pytest

from engine import LLM, EngineConfig, RerankParams, SamplingParams
from engine.config import EMBEDDED_EMBEDDER
from engine.embed.embedder import embedded_embedder_dir
from engine.rerank import default_mode
from engine.rerank.cascade import BELOW, cascade, top_k
from engine.rerank.fusion import convex
from engine.request import SeqKind
from tests.engine.conftest import assert_no_leaks, record_steps
from tests.engine.test_rerank_llm import DOCS, QUERY, _hf_mean_logprob

K = 2


def _engine(mode: str, **kw) -> LLM:
    # 256 KV blocks (4,096 tokens, more than any job here holds) instead of the default 1 GiB (1,456 blocks),
    # zero-filled at every build (~0.6 s of a core)
    kw.setdefault("num_kv_blocks", 256)
    return LLM(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode=mode, max_num_batched_tokens=256, **kw))


@pytest.fixture(scope="module")
def dense_llm() -> LLM:
    return _engine("dense")


@pytest.fixture(scope="module")
def cascade_llm() -> LLM:
    return _engine("cascade", rerank_cascade_k=K)


@pytest.fixture(scope="module")
def st_cosines() -> list[float]:
    """The query's cosine with each document, as sentence-transformers computes all-MiniLM-L6-v2's embeddings."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedded_embedder_dir()), device="cpu")
    q, *d = st.encode([QUERY, *DOCS], normalize_embeddings=True)
    return [float(q @ v) for v in d]


def _order(scores) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def test_cascade_arithmetic_by_hand():
    assert top_k([0.1, 0.9, 0.5, 0.9], 2) == [1, 3]  # ties: the earlier document first
    dense = [0.1, 0.9, 0.5, 0.7]
    # the top 2 by dense (1, 3) are fused over themselves: likelihood prefers 3, dense prefers 1 -> equal weights tie
    got = cascade([None, 0.2, None, 0.6], dense, 2)
    assert got[1] == got[3] == pytest.approx(0.5 + 0.5 * 0.5)
    assert got[2] == pytest.approx(BELOW * (1 + 0.5) / 2) and got[0] == pytest.approx(BELOW * (1 + 0.1) / 2)
    assert min(got[1], got[3]) > max(got[0], got[2])  # the re-scored above the rest, the rest in dense order
    assert cascade([0.3, 0.1], [0.2, 0.4], 5) == pytest.approx([0.5 + 0.5 * f for f in convex([0.3, 0.1], [0.2, 0.4])])


def test_the_default_with_an_embedder_is_dense_and_other_modes_are_one_setting_away():
    assert default_mode(EngineConfig(embedder=EMBEDDED_EMBEDDER)) == "dense"  # as `tandem serve` starts
    assert default_mode(EngineConfig(embedder=EMBEDDED_EMBEDDER, rerank_mode="fusion")) == "fusion"
    assert default_mode(EngineConfig()) == "likelihood"  # no embedder: the LLM alone


def test_dense_is_the_embedders_cosine_ranking_with_no_llm_pair(dense_llm, st_cosines):
    eng = dense_llm.engine
    assert eng.scorer.mode == "dense" and eng.model_info()["rerank_mode"] == "dense"
    records = record_steps(dense_llm)
    scores = dense_llm.rerank(QUERY, DOCS)
    assert scores == pytest.approx([(1 + c) / 2 for c in st_cosines], abs=1e-5)
    assert _order(scores) == _order(st_cosines)
    assert sum(r.rerank_pairs_scored for r in records) == 0 and sum(r.rerank_tokens for r in records) == 0
    # the query once and every document once, all in one step (the budget holds them)
    assert [r.embed_rows_done for r in records if r.embed_rows_done] == [1 + len(DOCS)]
    assert_no_leaks(dense_llm)


def test_dense_reports_the_embedders_tokens_and_truncate_none_refuses_a_cut_document(dense_llm):
    eng = dense_llm.engine
    long_doc = "honey " * 400
    top = dense_llm.rerank(QUERY, [DOCS[0], long_doc], ranked=True, return_documents=True)
    by_index = {r.index: r for r in top}
    own = len(eng.embedder.tokenizer(DOCS[0], add_special_tokens=False).input_ids)
    assert by_index[0].document_tokens == own and not by_index[0].truncated
    assert by_index[1].truncated and by_index[1].document_tokens == eng.embedder.max_length - 2  # [CLS] .. [SEP]
    with pytest.raises(ValueError, match=r"documents\[1\] is over the embedder's limit of 256"):
        dense_llm.rerank(QUERY, [DOCS[0], long_doc], RerankParams(truncate="none"))
    assert eng.model_info()["rerank_max_pair_tokens"] == eng.embedder.max_length
    assert_no_leaks(dense_llm)


def test_cascade_rescores_only_the_dense_top_k_and_keeps_the_rest_in_dense_order(cascade_llm, st_cosines, hf_model):
    eng = cascade_llm.engine
    assert eng.scorer.mode == "cascade"
    records = record_steps(cascade_llm)
    scores = cascade_llm.rerank(QUERY, DOCS)
    assert sum(r.rerank_pairs_scored for r in records) == K  # the LLM scored k pairs, not one per document
    top = top_k(st_cosines, K)
    rest = [i for i in _order(st_cosines) if i not in top]
    assert set(_order(scores)[:K]) == set(top) and _order(scores)[K:] == rest
    # the k against transformers' likelihood fused with sentence-transformers' cosine, the rest from the cosine
    pairs, _ = eng.scorer.pairs(QUERY, DOCS, RerankParams(), 10**6)
    likelihood = [math.exp(_hf_mean_logprob(hf_model, pairs[i].token_ids, pairs[i].logprob_start)) if i in top
                  else None for i in range(len(DOCS))]
    assert scores == pytest.approx(cascade(likelihood, st_cosines, K), abs=2e-3)
    # the pairs ran only after the embedder rows: no step before the last row's has a pair
    last_row_step = max(r.step for r in records if r.embed_rows_done)
    assert all(r.step > last_row_step for r in records if r.rerank_tokens)
    assert_no_leaks(cascade_llm)


def test_a_cascade_whose_dense_best_is_its_last_document_is_scored(cascade_llm, st_cosines):
    """The queued pairs wait for the one that fills their shared prefix: it must be the queue's head (the earliest
    arrival), not the dense best, or the head waits for a pair behind it forever."""
    eng = cascade_llm.engine
    docs = list(reversed(DOCS))  # the dense best (DOCS[0]) is now the last document
    eng.add_rerank("rev", QUERY, docs)
    job = eng._requests["rev"]
    finished = []
    for _ in range(200):  # a hang guard counted in steps: a few suffice
        finished += [o for o in eng.step() if o.request_id == "rev" and o.finished]
        if finished:
            break
    assert finished and finished[0].finish_reason == "stop"
    first = job.pairs[0]
    assert first.pair.wait_for is None and all(p.pair.wait_for is first for p in job.pairs[1:])
    assert first.arrival == min(p.arrival for p in job.pairs)
    assert set(_order(finished[0].scores)[:K]) == {len(DOCS) - 1 - i for i in top_k(st_cosines, K)}
    assert_no_leaks(cascade_llm)


def test_cascade_with_k_over_the_documents_orders_as_fusion():
    llm = _engine("cascade", rerank_cascade_k=len(DOCS))
    fusion = _engine("fusion")
    got, want = llm.rerank(QUERY, DOCS), fusion.rerank(QUERY, DOCS)
    assert got == pytest.approx([0.5 + 0.5 * w for w in want], abs=1e-5)


def test_an_aborted_cascade_frees_its_rows_and_queued_pairs(cascade_llm):
    eng = cascade_llm.engine
    eng.add_request("g", "Tell me about bees.", SamplingParams(max_tokens=4000, ignore_eos=True))
    eng.add_rerank("a", QUERY, DOCS * 3)
    job = eng._requests["a"]
    assert [s.kind for s in job.sequences] == [SeqKind.EMBED] * (1 + 3 * len(DOCS))  # pairs held, not queued
    while not job.pairs:  # until the rows have run and the chosen pairs are queued
        eng.step()
    assert len(job.pairs) == K and not job.held
    assert eng.abort("a") and eng.abort("g")
    outs = eng.step()
    assert {(o.request_id, o.finish_reason) for o in outs if o.finished} == {("a", "abort"), ("g", "abort")}
    assert not eng.has_unfinished()
    assert_no_leaks(cascade_llm)


class _Counting:
    """Wraps a tokenizer: records every text it is called on (one call may take a batch)."""

    def __init__(self, inner) -> None:
        self.inner, self.texts = inner, []

    def __call__(self, text, *args, **kw):
        self.texts.extend([text] if isinstance(text, str) else list(text))
        return self.inner(text, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("mode", ["dense", "cascade"])
def test_each_text_is_tokenized_once_per_tokenizer(mode, dense_llm, cascade_llm):
    eng = (dense_llm if mode == "dense" else cascade_llm).engine
    scorer_tok, embedder_tok = eng.scorer.__dict__.get("tokenizer"), eng.embedder.tokenizer
    counting_embedder = _Counting(embedder_tok)
    eng.embedder.tokenizer = counting_embedder
    if scorer_tok is not None:
        counting_llm = eng.scorer.tokenizer = _Counting(scorer_tok)
    try:
        eng.prepare_rerank("t", QUERY, DOCS)
    finally:
        eng.embedder.tokenizer = embedder_tok
        if scorer_tok is not None:
            eng.scorer.tokenizer = scorer_tok
    assert sorted(counting_embedder.texts) == sorted([QUERY, *DOCS])  # the query once, each document once
    if mode == "cascade":  # the LLM's tokenizer: every document once (and the query inside the template)
        assert sorted(t for t in counting_llm.texts if t in DOCS) == sorted(DOCS)


def test_max_document_tokens_cuts_each_document_in_the_tokens_of_the_model_reading_it(dense_llm, cascade_llm):
    params = RerankParams(max_document_tokens=3)
    dense = dense_llm.rerank(QUERY, DOCS, params, ranked=True)
    assert {r.document_tokens for r in dense} == {3} and not any(r.truncated for r in dense)
    emb = dense_llm.engine.embedder.tokenizer
    cut = [emb.decode(emb(d, add_special_tokens=False).input_ids[:3]) for d in DOCS]
    by_index = {r.index: r.score for r in dense}
    assert [by_index[i] for i in range(len(DOCS))] == pytest.approx(dense_llm.rerank(QUERY, cut), abs=1e-5)
    cascade = cascade_llm.rerank(QUERY, DOCS, params, ranked=True)
    assert {r.document_tokens for r in cascade} == {3}  # the LLM's tokens of the pairs
    with pytest.raises(ValueError, match="max_document_tokens must be >= 1"):
        RerankParams(max_document_tokens=0)


def test_in_a_dense_pipeline_the_default_rerank_gives_the_retrieval_order_back(dense_llm):
    """Issue 63 item 5: a pipeline that retrieved with tandem's own embedder (its vectors, ranked by cosine as a
    vector store does) and then reranks with the default mode gets the same order back: say so (start-up line,
    README, docs/reranking.md) and point to a trained reranker."""
    corpus = ["Lighthouses warn ships with a rotating beam of light.", "Bananas are rich in potassium.",
              "A fog horn sounds when the light cannot be seen.", "Ships carry cargo between ports.",
              "The keeper lit the lamp at dusk every night.", "Stock prices fell on Monday."]
    query = "how do lighthouses warn ships at night"
    vectors = dense_llm.embed(corpus)
    q = dense_llm.embed([query])[0]
    cosine = [sum(a * b for a, b in zip(q, v)) for v in vectors]
    retrieved = sorted(range(len(corpus)), key=lambda i: -cosine[i])[:4]  # the vector store's top 4, best first
    # (dense is the default with an embedder: test_the_default_with_an_embedder_is_dense_... above)
    reranked = dense_llm.rerank(query, [corpus[i] for i in retrieved], RerankParams(), ranked=True)
    assert [retrieved[r.index] for r in reranked] == retrieved
