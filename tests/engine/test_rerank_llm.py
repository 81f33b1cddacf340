"""The LLM as reranker (query likelihood, yes/no judge) in the shared scheduler: parity with transformers, prefix
reuse, independence from the rest of the step, fairness with decodes."""
import math

import pytest
import torch

from engine import RerankParams, SamplingParams
from engine.admission import AdmissionPolicy, Grant, Quota
from engine.outputs import check_top_n
from engine.step_time import TokenKind
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
    llm = make_llm(max_num_batched_tokens=384, tpot_target_ms=None)  # plain budget filling: a chunked prompt too
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
    # scoring_share 1.0: the whole remaining budget, so many pairs ride in one step beside the decodes
    llm = make_llm(rerank_mode=mode, scoring_share=1.0, tpot_target_ms=None)
    alone = llm.rerank(QUERY, [DOCS[2]])[0]
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"g{i}", f"Write a poem about number {i}", SamplingParams(max_tokens=8, temperature=0.0))
    eng.step()  # generations are now decoding
    # 24 pairs of ~15 tokens, the one under test in the middle: after the first pair (alone: it fills the query's
    # prefix) the other 23 ride one step beside the decodes (64 pairs before: four such steps of 17, no more tested)
    others = [f"Filler document number {i} about {'bees ' * (i % 9)}honey." for i in range(23)]
    records = record_steps(llm)
    eng.add_rerank("crowded", QUERY, others[:11] + [DOCS[2]] + others[11:])
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    crowded = next(o for o in outs if o.request_id == "crowded").scores[11]
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
    ranked = llm.rerank(QUERY, DOCS, ranked=True, top_n=2, return_documents=True)
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:2]
    assert [r.index for r in ranked] == order
    assert [r.document for r in ranked] == [DOCS[i] for i in order]
    assert [r.score for r in ranked] == pytest.approx([scores[i] for i in order], abs=1e-6)
    assert all(r.document is None for r in llm.rerank(QUERY, DOCS, ranked=True))
    with pytest.raises(ValueError, match="ranked=True"):
        llm.rerank(QUERY, DOCS, top_n=2)
    assert_no_leaks(llm)


def test_rerank_job_shares_steps_with_running_decodes(llm):
    """A job of many pairs is spread over many steps beside four decoding generations: none of their steps is skipped
    while it runs, their tokens are the ones they get alone, and no step passes the budget. Sized so the whole job runs
    while the generations decode (24 pairs of ~30 tokens at scoring_share 0.5 of a 128-token step: ~12 steps, against
    their 32 tokens), so every step the job rides in is one where a skipped decode would show; 200 pairs (the old
    size) spent ~50 more steps scoring alone after the decodes ended, which tested nothing more."""
    prompts = [f"List facts about planet number {i}:" for i in range(4)]
    max_tokens = 32
    gen = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    solo = [o.token_ids for o in llm.generate(prompts, gen)]

    shared = make_llm(max_num_batched_tokens=128)
    eng = shared.engine
    records = record_steps(shared)
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, gen)
    outs = eng.step()  # prefill the generations
    docs = [f"Document {i}: bees, {'flowers ' * (i % 7)}and honey." for i in range(24)]
    eng.add_rerank("job", QUERY, docs)
    while eng.has_unfinished():
        outs.extend(eng.step())
    tokens = {f"g{i}": [t for o in outs if o.request_id == f"g{i}" for t in o.new_token_ids] for i in range(4)}
    scores = next(o.scores for o in outs if o.request_id == "job")
    assert [tokens[f"g{i}"] for i in range(4)] == solo
    assert scores is not None and len(scores) == len(docs) and all(0.0 <= s <= 1.0 for s in scores)
    job_steps = [r for r in records if "job" in r.request_ids]
    assert len(job_steps) > 5  # the job was spread over many steps
    last_decode = {g: _finish_step(records, g) for g in tokens}  # the step that decoded each one's last token
    assert _finish_step(records, "job") < min(last_decode.values())  # as sized: the job ends while all decode
    live = [r for r in job_steps if r.rerank_pairs and len(r.decode_request_ids) > 0]
    assert live, "no step held decode tokens and rerank pairs together"
    for r in job_steps:
        # (the old check also asked len(tokens[g]) < 48 of the final token lists, always false: it never ran)
        still_running = [g for g in tokens if r.step <= last_decode[g]]
        assert still_running and set(still_running) <= set(r.decode_request_ids), f"step {r.step} skipped a decode"
    assert max(r.budget_used for r in records) <= 128


def _finish_step(records, rid):
    return max(r.step for r in records if rid in r.request_ids)


@pytest.mark.parametrize("query, docs, params, field", [
    ("", ["a"], None, "query"),
    ("q", [], None, "documents"),
    ("q", ["a"] * 1001, None, "max_rerank_documents"),
    ("q", ["word " * 9000], RerankParams(truncate="none"), "documents\\[0\\]"),
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


@pytest.mark.parametrize("top_n", [0, -1, 1.5])
def test_top_n_below_one_is_rejected(top_n):
    """top_n shapes the answer, not the engine's work: checked where the answer is ranked (rank_scores' callers)."""
    with pytest.raises(ValueError, match="top_n"):
        check_top_n(top_n)


@pytest.fixture(scope="module")
def short_llm():
    """A 256-token context: documents past it are cut (truncate="end") or refused ("none")."""
    return make_llm(max_model_len=256)


def test_long_document_is_truncated_by_default_and_the_result_says_so(short_llm):
    eng = short_llm.engine
    assert eng.model_info()["rerank_max_pair_tokens"] == 256
    assert "--max-model-len" in eng.model_info()["rerank_limit_by"]
    ranked = short_llm.rerank(QUERY, ["honey " * 600, DOCS[0]], ranked=True, top_n=2)
    by_index = {r.index: r for r in ranked}
    pair = _pair_ids(eng, QUERY, ["honey " * 600])[0]
    fixed = len(pair.token_ids) - pair.document_tokens
    assert by_index[0].truncated and by_index[0].document_tokens == 256 - fixed
    assert not by_index[1].truncated
    assert by_index[1].document_tokens == len(eng.tokenizer(DOCS[0], add_special_tokens=False).input_ids)
    assert_no_leaks(short_llm)


def test_truncate_none_names_the_limit_and_the_setting_that_raises_it(short_llm):
    with pytest.raises(ValueError, match=r"documents\[0\].*over the rerank pair limit of 256 "
                                         r"\(max_model_len \(tandem serve --max-model-len\)\)"):
        short_llm.engine.add_rerank("bad", QUERY, ["honey " * 600], RerankParams(truncate="none"))


def test_the_pair_limit_is_the_model_context_not_the_step_budget(llm):
    info = llm.engine.model_info()
    assert info["rerank_max_pair_tokens"] == info["max_model_len"] == 8192
    assert info["rerank_max_pair_tokens"] > llm.engine.config.max_num_batched_tokens
    assert "max_position_embeddings" in info["rerank_limit_by"]


def test_a_2000_token_document_is_scored_whole_and_equals_transformers(llm, hf_model):
    """Four times the step budget: prefilled in chunks over several steps, not truncated, and its query likelihood is
    transformers' over the whole pair within 1e-4."""
    doc = " ".join(f"Bees visit flower number {i} and carry its nectar back to the hive." for i in range(150))
    records = record_steps(llm)
    ranked = llm.rerank(QUERY, [doc], ranked=True)
    pair = _pair_ids(llm.engine, QUERY, [doc])[0]
    assert 2000 <= pair.document_tokens and not pair.truncated
    assert ranked[0].document_tokens == pair.document_tokens and not ranked[0].truncated
    assert sum(1 for r in records if r.rerank_tokens) >= -(-len(pair.token_ids) // llm.engine.scheduler.budget)
    ref = _hf_mean_logprob(hf_model, pair.token_ids, pair.logprob_start)
    assert abs(math.log(ranked[0].score) - ref) <= 1e-4
    assert_no_leaks(llm)


class ChunkPolicy(AdmissionPolicy):
    """Prompts get 48 tokens a step (so a long one is prefilled in chunks beside the pairs); rerank pairs get exactly
    `chunk` tokens a step (a chunk of a pair, or pairs)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def plan(self, view) -> Quota:
        # a long prompt is prefilled 48 tokens a step: it stays chunked beside the pairs
        return Quota((Grant(TokenKind.PREFILL, 48), Grant(None, self.chunk)))


@pytest.fixture(scope="module")
def chunk_engines():
    # No prefix cache: every chunk of every pair is computed, so a pair of n tokens takes exactly ceil(n / chunk) steps.
    return {mode: make_llm(rerank_mode=mode, admission=ChunkPolicy(10**6), enable_prefix_caching=False)
            for mode in ("likelihood", "judge")}


@pytest.mark.parametrize("mode", ["likelihood", "judge"])
def test_a_pair_split_over_2_3_and_n_steps_scores_as_whole_beside_decodes_and_a_chunked_prompt(
        mode, chunk_engines, hf_model):
    llm = chunk_engines[mode]
    eng, policy = llm.engine, llm.engine.scheduler.policy
    doc = DOCS[2] + " " + DOCS[0]
    pair = _pair_ids(eng, QUERY, [doc])[0]
    n = len(pair.token_ids)
    policy.chunk = 10**6
    whole = llm.rerank(QUERY, [doc])[0]
    yes, no = eng.scorer.yes_id if mode == "judge" else None, eng.scorer.no_id if mode == "judge" else None
    ref = (math.exp(_hf_mean_logprob(hf_model, pair.token_ids, pair.logprob_start)) if mode == "likelihood"
           else _hf_judge_scores(hf_model, [pair.token_ids], yes, no)[0])
    assert abs(whole - ref) <= 1e-4
    # 16 tokens: the decodes outlive the pair's first two steps (all that is asserted of them) in every split
    gen = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for parts in (2, 3, 7, n):
        policy.chunk = -(-n // parts)
        for i in range(2):
            eng.add_request(f"g{parts}/{i}", f"Count slowly from {i} to fifty:", gen)
        eng.step()  # the generations now decode
        eng.add_request(f"long{parts}", f"Tell me about honey, part {parts}. " * 30, gen)
        records = record_steps(llm)
        eng.add_rerank(f"job{parts}", QUERY, [doc])
        outs = []
        while eng.has_unfinished():
            outs.extend(eng.step())
        eng.remove_observer(records.append)
        score = next(o.scores[0] for o in outs if o.request_id == f"job{parts}")
        job_steps = [r for r in records if f"job{parts}" in r.request_ids]
        assert len(job_steps) == -(-n // policy.chunk) >= min(parts, 2)
        assert [r.rerank_tokens for r in job_steps] == [policy.chunk] * (len(job_steps) - 1) + [
            n - policy.chunk * (len(job_steps) - 1)]
        assert job_steps[0].decode_tokens and job_steps[1].decode_tokens  # chunks rode beside the decodes
        assert job_steps[0].prefill_tokens  # and beside a chunk of the long prompt
        assert score == pytest.approx(whole, abs=1e-5), parts
        assert abs(score - ref) <= 1e-4
    assert_no_leaks(llm)


def test_abort_and_preemption_in_the_middle_of_a_pair_leak_nothing_and_a_preempted_pair_scores_as_whole(
        chunk_engines):
    llm = chunk_engines["likelihood"]
    eng, policy = llm.engine, llm.engine.scheduler.policy
    doc = " ".join(DOCS)
    policy.chunk = 10**6
    whole = llm.rerank(QUERY, [doc])[0]
    policy.chunk = 16
    eng.add_rerank("gone", QUERY, [doc])
    eng.step()
    eng.step()
    pair = next(s for s in eng.scheduler.running if s.request_id == "gone")
    assert 0 < pair.num_computed_tokens < pair.num_tokens and pair.block_table  # half-scored, holding KV
    assert eng.abort("gone")
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    assert [(o.request_id, o.finish_reason) for o in outs] == [("gone", "abort")]
    assert_no_leaks(llm)

    eng.add_rerank("preempted", QUERY, [doc])
    for _ in range(3):
        eng.step()
    pair = next(s for s in eng.scheduler.running if s.request_id == "preempted")
    assert 0 < pair.num_computed_tokens < pair.num_tokens
    eng.scheduler.preempt(pair)  # what a decode short of a block does to the newest running sequence
    assert pair.num_computed_tokens == 0 and not pair.block_table and pair.num_preemptions == 1
    outs = []
    while eng.has_unfinished():
        outs.extend(eng.step())
    score = next(o.scores[0] for o in outs if o.request_id == "preempted")
    assert score == pytest.approx(whole, abs=1e-5)
    policy.chunk = 10**6
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
