"""The LLM as reranker (query likelihood, yes/no judge) in the shared scheduler: parity with transformers, prefix
reuse, independence from the rest of the step, fairness with decodes."""
import math

import pytest
import torch

from engine import RerankParams, SamplingParams
from tests.engine.conftest import assert_no_leaks, make_llm, record_steps

QUERY = "How do bees make honey?"
DOCS = ["Bees collect nectar from flowers and store it in their honey stomach.",
        "The stock market fell three percent on Tuesday.",
        "Worker bees fan their wings to evaporate water from nectar, turning it into honey.",
        "A recipe for tomato soup with basil.",
        "Honeybees live in colonies with a single queen."]


def _hf_judge_scores(hf_model, pair_token_ids, yes_id, no_id):
    scores = []
    with torch.inference_mode():
        for ids in pair_token_ids:
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            scores.append(torch.softmax(logits[[yes_id, no_id]], dim=-1)[0].item())
    return scores


def _hf_mean_logprob(hf_model, ids: list[int], start: int) -> float:
    """Mean log-probability of ids[start:] from one plain transformers forward of the whole pair."""
    with torch.inference_mode():
        logprobs = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    targets = torch.tensor(ids[start:])
    return logprobs[start - 1:-1].gather(1, targets[:, None]).mean().item()


def _pair_ids(eng, query, docs, params=None):
    pairs, _ = eng.scorer.pairs(query, docs, params or RerankParams(), 10**6)
    return pairs


@pytest.fixture(scope="module")
def judge_llm():
    return make_llm(rerank_mode="judge")


def test_default_mode_is_query_likelihood(llm):
    assert llm.engine.scorer.mode == "likelihood" and llm.engine.model_info()["rerank_mode"] == "likelihood"


def test_judge_matches_transformers_and_reuses_prefix(judge_llm, hf_model):
    llm = judge_llm
    records = record_steps(llm)
    scores = llm.rerank(QUERY, DOCS)
    eng = llm.engine
    judge = eng.scorer
    template = judge.template(QUERY, RerankParams())
    pairs = [p.token_ids for p in _pair_ids(eng, QUERY, DOCS)]
    assert pairs[0][:len(template.prefix)] == template.prefix
    ref = _hf_judge_scores(hf_model, pairs, judge.yes_id, judge.no_id)
    assert len(scores) == len(DOCS)
    assert max(abs(a - b) for a, b in zip(scores, ref)) <= 1e-3
    job_steps = [r for r in records if r.rerank_pairs]
    assert job_steps[0].rerank_pairs == 1  # the first pair runs alone and fills the query prefix
    full_prefix_blocks = (len(template.prefix) // eng.config.block_size) * eng.config.block_size
    assert full_prefix_blocks > 0
    assert sum(r.cached_tokens for r in job_steps[1:]) >= (len(DOCS) - 1) * full_prefix_blocks
    assert sum(r.rerank_pairs for r in job_steps) == len(DOCS)
    assert_no_leaks(llm)


def test_likelihood_matches_transformers_beside_decodes_and_a_chunked_prompt(hf_model):
    """Pairs ride one ragged step with running decodes and a prompt whose prefill is split into chunks; each
    score is exp(mean log-prob of the query tokens), against one plain transformers forward of the same pair."""
    llm = make_llm(max_num_batched_tokens=384)
    eng = llm.engine
    records = record_steps(llm)
    gen = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"g{i}", f"Count slowly from {i} to twenty:", gen)
    eng.step()  # the generations now decode
    eng.add_request("long", "Tell me about honey. " * 120, gen)  # ~600 tokens: prefilled in chunks
    docs = DOCS + [DOCS[0]]  # a repeated document: its query span must still be computed, not cached
    eng.add_rerank("job", QUERY, docs)
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    scores = next(o.scores for o in outs if o.request_id == "job")
    mixed = [r for r in records if r.rerank_pairs and r.decode_tokens and r.prefill_tokens]
    assert mixed, "no step held rerank pairs, decodes and a prefill chunk together"
    for pair, score in zip(_pair_ids(eng, QUERY, docs), scores):
        ref = _hf_mean_logprob(hf_model, pair.token_ids, pair.logprob_start)
        assert abs(math.log(score) - ref) <= 1e-4
        assert abs(score - math.exp(ref)) <= 1e-4
    assert scores[-1] == pytest.approx(scores[0], abs=1e-6)
    assert_no_leaks(llm)


def test_likelihood_query_span_is_never_taken_from_the_prefix_cache(llm):
    doc = "Bees make honey from nectar. " * 12
    first = llm.rerank(QUERY, [doc])[0]
    records = record_steps(llm)
    again = llm.rerank(QUERY, [doc])[0]  # the whole document now sits in the prefix cache
    pair = _pair_ids(llm.engine, QUERY, [doc])[0]
    assert sum(r.cached_tokens for r in records) >= llm.engine.config.block_size
    assert sum(r.cached_tokens for r in records) <= pair.logprob_start - 1
    assert again == pytest.approx(first, abs=1e-6)
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["likelihood", "judge"])
def test_pair_score_does_not_depend_on_batch_composition(mode):
    # rerank_share 1.0: the whole remaining budget, so many pairs ride in one step beside the decodes
    llm = make_llm(rerank_mode=mode, rerank_share=1.0)
    alone = llm.rerank(QUERY, [DOCS[2]])[0]
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"g{i}", f"Write a poem about number {i}", SamplingParams(max_tokens=8, temperature=0.0))
    eng.step()  # generations are now decoding
    others = [f"Filler document number {i} about {'bees ' * (i % 9)}honey." for i in range(63)]
    records = record_steps(llm)
    eng.add_rerank("crowded", QUERY, others[:31] + [DOCS[2]] + others[31:])
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    crowded = next(o for o in outs if o.request_id == "crowded").scores[31]
    assert abs(crowded - alone) <= 1e-5
    assert max(r.rerank_pairs for r in records) >= 12 and any(r.decode_tokens for r in records if r.rerank_pairs)
    assert_no_leaks(llm)


def test_default_mode_ranks_the_obvious_document_first(llm):
    """The issue's example (the judge put the stock-market sentence above the bees one) and two more."""
    cases = [
        ("how do bees make honey", ["The stock market fell sharply on Tuesday.",
                                    "Bees collect nectar from flowers and turn it into honey in the hive.",
                                    "A recipe for tomato soup with basil."], 1),
        ("what is the capital of France", ["Bananas are rich in potassium.", "Paris is the capital of France.",
                                           "The Pacific is the largest ocean."], 1),
        ("how to change a flat tire", ["Loosen the lug nuts, jack up the car, swap the wheel, and tighten the nuts.",
                                       "Jupiter has dozens of moons.", "Knitting needs yarn and two needles."], 0),
    ]
    for query, docs, relevant in cases:
        scores = llm.rerank(query, docs)
        assert max(range(len(docs)), key=scores.__getitem__) == relevant, (query, scores)


def test_ranked_results_honour_top_n_and_return_documents(llm):
    scores = llm.rerank(QUERY, DOCS)
    ranked = llm.rerank(QUERY, DOCS, RerankParams(top_n=2, return_documents=True), ranked=True)
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
    assert [r.index for r in ranked] == order
    assert [r.document for r in ranked] == [DOCS[i] for i in order]
    assert [r.score for r in ranked] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert all(r.document is None for r in llm.rerank(QUERY, DOCS, ranked=True))
    with pytest.raises(ValueError, match="ranked=True"):
        llm.rerank(QUERY, DOCS, RerankParams(top_n=2))
    assert_no_leaks(llm)


def test_rerank_job_shares_steps_with_running_decodes(llm):
    prompts = [f"List facts about planet number {i}:" for i in range(4)]
    gen = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    solo = [o.token_ids for o in llm.generate(prompts, gen)]

    eng = make_llm(max_num_batched_tokens=128).engine
    records = []
    eng.add_observer(records.append)
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, gen)
    outs = eng.step()  # prefill the generations
    docs = [f"Document {i}: bees, {'flowers ' * (i % 7)}and honey." for i in range(200)]
    eng.add_rerank("job", QUERY, docs)
    while eng.has_unfinished():
        outs.extend(eng.step())
    tokens = {f"g{i}": [t for o in outs if o.request_id == f"g{i}" for t in o.new_token_ids] for i in range(4)}
    scores = next(o.scores for o in outs if o.request_id == "job")
    assert [tokens[f"g{i}"] for i in range(4)] == solo
    assert scores is not None and len(scores) == 200 and all(0.0 <= s <= 1.0 for s in scores)
    job_steps = [r for r in records if "job" in r.request_ids]
    assert len(job_steps) > 5  # the job was spread over many steps
    live = [r for r in job_steps if r.rerank_pairs and len(r.decode_request_ids) > 0]
    assert live, "no step held decode tokens and rerank pairs together"
    for r in job_steps:
        still_running = [g for g in tokens if len(tokens[g]) < 48 and r.step < _finish_step(records, g)]
        assert set(still_running) <= set(r.decode_request_ids), f"step {r.step} skipped a decode"
    assert max(r.budget_used for r in records) <= 128


def _finish_step(records, rid):
    return max(r.step for r in records if rid in r.request_ids)


@pytest.mark.parametrize("query, docs, params, field", [
    ("", ["a"], None, "query"),
    ("q", [], None, "documents"),
    ("q", ["a"] * 1001, None, "max_rerank_documents"),
    ("q", ["word " * 5000], RerankParams(truncate="none"), "documents\\[0\\]"),
])
def test_bad_rerank_input_names_the_field(llm, query, docs, params, field):
    eng = llm.engine
    eng.add_request("bystander", "Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    with pytest.raises(ValueError, match=field):
        eng.add_rerank("bad", query, docs, params)
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert [o.finish_reason for o in outs if o.finished] == ["length"]
    assert_no_leaks(llm)


def test_top_n_below_one_is_rejected():
    with pytest.raises(ValueError, match="top_n"):
        RerankParams(top_n=0)


def test_long_document_is_truncated_by_default(llm):
    scores = llm.rerank(QUERY, ["honey " * 5000, DOCS[0]])
    assert len(scores) == 2
    assert_no_leaks(llm)


def test_abort_rerank_job_frees_blocks(llm):
    eng = llm.engine
    eng.add_rerank("gone", QUERY, DOCS * 10)
    eng.step()
    assert eng.abort("gone")
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert [(o.request_id, o.finish_reason, o.scores) for o in outs] == [("gone", "abort", None)]
    assert_no_leaks(llm)
