"""The retrieval quality benchmark's bookkeeping: metrics against hand-computed cases, the BM25 first stage, the
counting of queries whose relevant document was not retrieved, and the quick run's JSON.

No wall-clock assertions and no expected scores of any ranker: only what the arithmetic must give.
"""
import json
import math

import pytest

from bench import rerank_quality as rq
from bench.datasets import CORPORA, RetrievalCorpus, looks_english

L3, L4, L5 = 1 / math.log2(3), 1 / math.log2(4), 1 / math.log2(5)  # discounts of ranks 2, 3, 4


# ---- metrics ----------------------------------------------------------------------------------------------------

def test_ndcg_one_relevant_document():
    assert rq.ndcg_at([7, 3, 5], [7]) == pytest.approx(1.0)
    assert rq.ndcg_at([5, 3, 7], [3]) == pytest.approx(L3)
    assert rq.ndcg_at([5, 3, 7], [7]) == pytest.approx(L4)
    assert rq.ndcg_at(list(range(20)), [10]) == 0.0  # rank 11: outside the top 10
    assert rq.ndcg_at(list(range(20)), [9]) == pytest.approx(1 / math.log2(11))  # rank 10: inside


def test_ndcg_several_relevant_documents():
    # relevant at ranks 2 and 4: DCG = 1/log2(3) + 1/log2(5); ideal = 1 + 1/log2(3)
    assert rq.ndcg_at([1, 2, 3, 4], [2, 4]) == pytest.approx((L3 + L5) / (1 + L3))
    assert rq.ndcg_at([2, 4, 1, 3], [2, 4]) == pytest.approx(1.0)
    # one of the two relevant documents never retrieved: the ideal still counts both
    assert rq.ndcg_at([1, 2, 3], [1, 99]) == pytest.approx(1 / (1 + L3))
    assert rq.ndcg_at([1, 2, 3], [98, 99]) == 0.0
    # more than 10 relevant: the ideal DCG stops at 10
    assert rq.ndcg_at(list(range(10)), list(range(15))) == pytest.approx(1.0)


def test_mrr_at_10():
    assert rq.mrr_at([4, 5, 6], [6]) == pytest.approx(1 / 3)
    assert rq.mrr_at([4, 5, 6], [5, 6]) == pytest.approx(1 / 2)  # the first relevant one counts
    assert rq.mrr_at(list(range(20)), [10]) == 0.0  # rank 11
    assert rq.mrr_at(list(range(20)), [9]) == pytest.approx(0.1)
    assert rq.mrr_at([1, 2], [3]) == 0.0


def test_recall_at_1():
    assert rq.recall_at([2, 1], [2], 1) == 1.0
    assert rq.recall_at([2, 1], [1], 1) == 0.0
    assert rq.recall_at([2, 1], [1, 2], 1) == pytest.approx(0.5)  # one of two relevant documents
    assert rq.recall_at([2, 1, 3], [1, 2, 9], 3) == pytest.approx(2 / 3)


def test_mean_and_standard_error():
    mean, se = rq.mean_stderr([0, 1, 1, 0])
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt(1 / 3) / 2)  # sample std (ddof=1) / sqrt(n)
    assert rq.mean_stderr([0.25]) == (0.25, 0.0)
    assert rq.mean_stderr([0.3, 0.3, 0.3])[1] == pytest.approx(0.0)


def test_summarize_reports_each_metric_with_its_stderr():
    s = rq.summarize([rq.query_metrics([1, 2], [1]), rq.query_metrics([1, 2], [2])])
    assert s["queries"] == 2
    assert s["recall@1"] == pytest.approx(0.5) and s["recall@1_stderr"] == pytest.approx(0.5)
    assert s["mrr@10"] == pytest.approx(0.75) and s["mrr@10_stderr"] == pytest.approx(0.25)
    assert s["ndcg@10"] == pytest.approx((1 + L3) / 2)


def test_rerank_order_sorts_by_score_and_keeps_first_stage_order_on_ties():
    assert rq.rerank_order([10, 11, 12], [0.5, 0.9, 0.5]) == [11, 10, 12]
    assert rq.rerank_order([10, 11, 12], [0.0, 0.0, 0.0]) == [10, 11, 12]


# ---- first stage and the evaluation of a run ----------------------------------------------------------------------

FILLER = ["The stock market fell sharply on Tuesday after the report.", "A recipe for sourdough bread with rye flour.",
          "The train to Lyon leaves at nine from platform four.", "Football scores from the weekend league games.",
          "How to change a flat tyre on a mountain bike.", "Tax returns are due at the end of April this year."]


def test_bm25_top_k_finds_the_planted_document():
    planted = "Bees collect nectar from flowers and turn it into honey in the hive."
    docs = FILLER[:3] + [planted] + FILLER[3:]
    bm25 = rq.BM25Retriever(docs)
    top = bm25.top("how do bees make honey", 3)
    assert top[0] == 3
    assert len(top) == 3 and len(set(top)) == 3
    assert bm25.top("bees honey", 100) == [3] + [i for i in range(len(docs)) if i != 3]  # ties: id order
    assert bm25.top("zzzz qqqq", 2) == [0, 1]  # no known word: all scores 0, id order


def _sample(candidates, relevant, documents=10):
    corpus = RetrievalCorpus("t", "test", tuple(f"q{i}" for i in range(len(candidates))),
                             tuple(f"d{i}" for i in range(documents)), tuple(tuple(r) for r in relevant))
    texts = {d: f"d{d}" for c in candidates for d in c}
    return rq.Sample(corpus, list(range(len(candidates))), list(corpus.queries), candidates, texts, 0.1)


def test_a_query_whose_relevant_document_was_not_retrieved_counts_as_zero():
    s = _sample([[1, 2, 3], [4, 5, 6]], [[2], [9]])  # query 1's relevant document is not among its candidates
    bm25 = rq.evaluate(s, None, 3)
    assert bm25["queries"] == 2
    assert bm25["ndcg@10"] == pytest.approx(L3 / 2) and bm25["mrr@10"] == pytest.approx(0.25)
    perfect = rq.evaluate(s, [[0, 1, 0], [0, 0, 0]], 3)  # the best any reranker can do
    assert perfect["ndcg@10"] == pytest.approx(0.5) and perfect["recall@1"] == pytest.approx(0.5)
    assert rq.bm25_recall(s, 3) == {"recall": 0.5, "recall_stderr": pytest.approx(0.5), "queries_with_a_relevant": 0.5}
    assert rq.bm25_recall(s, 1)["recall"] == 0.0


def test_depth_k_reranks_only_the_first_k_candidates():
    s = _sample([[1, 2, 3, 4]], [[4]])
    scores = [[0.1, 0.2, 0.3, 0.9]]
    assert rq.evaluate(s, scores, 2)["ndcg@10"] == 0.0  # the relevant document is 4th: not in the top 2
    assert rq.evaluate(s, scores, 4)["ndcg@10"] == pytest.approx(1.0)


def test_rankers_that_scored_fewer_queries_are_evaluated_on_those():
    s = _sample([[1, 2], [3, 4], [5, 6]], [[2], [3], [6]])
    assert rq.evaluate(s, None, 2)["queries"] == 3
    llm = rq.evaluate(s, [[0, 1]], 2)  # scored only the first query (--llm-queries 1)
    assert llm["queries"] == 1 and llm["ndcg@10"] == pytest.approx(1.0)
    assert rq.evaluate(s, None, 2, 1)["ndcg@10"] == pytest.approx(L3)  # BM25 on the same first query
    assert rq.bm25_recall(s, 1, 2)["recall"] == pytest.approx(0.5)
    assert rq.paired_margin(s, [[0, 1]], None, 2)["queries"] == 1


def test_paired_margin_over_bm25():
    s = _sample([[1, 2], [3, 4]], [[2], [3]])
    m = rq.paired_margin(s, [[0, 1], [1, 0]], None, 2)  # fixes query 0, keeps query 1
    assert m["diff"] == pytest.approx((1 - L3) / 2)
    assert m["diff_stderr"] == pytest.approx((1 - L3) / 2)  # differences (1 - L3, 0): std (1 - L3)/sqrt(2)
    assert m["diff_in_stderrs"] == pytest.approx(1.0)
    assert rq.paired_margin(s, [[0, 1], [0, 1]], [[0, 1], [0, 1]], 2)["diff_in_stderrs"] is None


# ---- corpora --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CORPORA))
def test_corpora_load_with_relevant_documents_in_range(name):
    c = CORPORA[name]()
    assert len(c.queries) >= 200 and len(c.queries) == len(c.relevant)
    assert len(c.documents) >= len(set(d for r in c.relevant for d in r))
    assert all(r and all(0 <= d < len(c.documents) for d in r) for r in c.relevant)
    assert all(q.strip() for q in c.queries) and all(d.strip() for d in c.documents)


def test_looks_english():
    assert looks_english("My neck hurts from leaning over my phone, is it serious?")
    assert not looks_english("Podrías decirme cuántas semanas después del parto se hace la primera visita")
    assert not looks_english("ساعدني يابوت انا عندي تليف في الكبد")


# ---- the quick run ------------------------------------------------------------------------------------------------

def _one_query(monkeypatch):
    """The quick run on one query a corpus instead of two: every ranker, corpus, K and check still runs and is
    written (what these tests assert); a second query only doubles the LLM modes' scoring (about half of each test)."""
    monkeypatch.setitem(rq.QUICK, "queries", 1)


def test_quick_run_writes_every_ranker_and_corpus(tmp_path, monkeypatch):
    _one_query(monkeypatch)
    out = tmp_path / "rerank_quality.json"
    rq.main(["--quick", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["quick"] is True and not result["unavailable_modes"]
    assert set(result["rankers"]) == {*rq.RANKERS, "cascade@3"}
    assert set(result["corpora"]) == set(CORPORA)
    assert result["default_mode"] == "dense"  # the embedded models with the embedded embedder, as tandem serve
    for name, c in result["corpora"].items():
        for k in result["ks"]:
            row = c[f"k{k}"]
            assert 0 <= row["bm25_recall"]["recall"] <= 1
            for ranker in rq.RANKERS:
                m = row[ranker]
                assert m["queries"] == c["queries"] == rq.QUICK["queries"]
                for metric in rq.METRICS:
                    assert 0 <= m[metric] <= 1 and m[f"{metric}_stderr"] >= 0
                assert m["recall@1"] <= m["mrr@10"] + 1e-9 and m["mrr@10"] <= m["ndcg@10"] + 1e-9  # one relevant
        for mode in rq.CHECKED_MODES:  # the engine's own mode = the ranker computed from its parts
            check = result[f"{mode}_check"][name]
            assert check["queries"] == 1 and check["same_order"] == 1 and check["max_abs_diff"] < 1e-4, mode
        assert "cascade@3" in c["k4"]  # the sweep's extra k
        for ranker in [r for r in rq.RANKERS[1:] if r not in rq.FUSIONS]:
            sp = c["speed"][ranker]
            assert sp["pairs"] == c["queries"] * max(result["ks"]) and sp["pairs_s"] > 0
        for mode in rq.LLM_MODES:
            assert 0 <= c["speed"][mode]["cached_fraction"] <= 1 and c["speed"][mode]["computed_tokens"] > 0
    t = result["targets"]
    assert t["default_mode"] == result["default_mode"]
    assert set(t["per_k"]) == {f"k{k}" for k in result["ks"]}
    assert isinstance(t["met"], bool)
    cascade = t["vs_fusion"]["cascade"]  # issue #47: each mode against fusion, per corpus and K
    assert set(cascade["rows"]) == {f"{n}_k{k}" for n in CORPORA for k in result["ks"]}
    assert isinstance(cascade["met"], bool) and "dense" in t["vs_fusion"]
    assert isinstance(t["default_vs_fusion_stderrs"], float)  # the default (dense) against fusion, worst case


def test_scores_from_a_pair_file_stand_in_for_the_mode_and_are_tied_to_their_texts(tmp_path, monkeypatch):
    """--pairs-out, then bench.score_pairs (as on a GPU), then --scores-in: the likelihood scores come from the file,
    the fusion computed from them matches the engine's own fusion mode, and a run on other texts refuses them."""
    from bench import score_pairs

    _one_query(monkeypatch)
    pairs, scores, out = tmp_path / "pairs.json.gz", tmp_path / "scores.json.gz", tmp_path / "rq.json"
    assert rq.main(["--quick", "--pairs-out", str(pairs)]) == {}
    written = score_pairs.read_json(pairs)
    assert set(written["corpora"]) == set(CORPORA) and written["setting"]["doc_tokens"] == rq.QUICK["doc_tokens"]
    for c in written["corpora"].values():
        assert len(c["queries"]) == rq.QUICK["queries"] and all(len(d) == max(rq.QUICK["ks"]) for d in c["candidates"])
    got = score_pairs.main([str(pairs), "--threads", "1", "--out", str(scores)])
    assert got["device"] == "cpu" and got["mode"] == "likelihood"
    result = rq.main(["--quick", "--skip", "judge", "cross-encoder", "--scores-in", f"likelihood={scores}",
                      "--out", str(out)])
    for name, c in result["corpora"].items():
        sp = c["speed"]["likelihood"]
        assert sp["scored_by"] == "bench.score_pairs" and sp["device"] == "cpu" and sp["pairs"] == rq.QUICK["queries"] * 4
        assert "fusion" in c["k4"] and "rrf" in c["k4"]
        check = result["fusion_check"][name]
        assert check["same_order"] == check["queries"] == 1 and check["max_abs_diff"] < 1e-4
    with pytest.raises(SystemExit, match="not this run's"):
        rq.main(["--quick", "--seed", "1", "--skip", "judge", "cross-encoder", "--scores-in",
                 f"likelihood={scores}", "--out", str(out)])
