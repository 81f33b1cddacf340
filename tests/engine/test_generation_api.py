"""The engine side of the generation API (#20): n > 1 sharing the prompt's KV blocks, prompt and generated-token
log-probabilities against transformers, usage, min_tokens and the structured-output wiring."""
import sys
import types

import pytest
import torch

from engine import SamplingParams
from engine.config import StructuredOutputsParams
from tests.engine.conftest import assert_no_leaks, hf_greedy_one_at_a_time, make_llm, record_steps

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships far out at sea "
        "watched for its beam, and the keeper wrote each one down in a worn leather book beside the window. In "
        "winter the storms came early, the stairs were cold, and the gulls sheltered under the gallery rail.")


@pytest.fixture(scope="module")
def plain_llm():
    """No prefix caching and a small step budget, so prompts are prefilled in chunks."""
    return make_llm(enable_prefix_caching=False, max_num_batched_tokens=24)


@pytest.fixture(params=["caching", "no-caching"])
def any_llm(request, llm, plain_llm):
    return llm if request.param == "caching" else plain_llm


def _ids(tokenizer, n: int, salt: str = "") -> list[int]:
    ids = tokenizer(salt + TEXT).input_ids[:n]
    assert len(ids) == n
    return ids


def _run(eng, rid: str, prompt, params: SamplingParams) -> list:
    """Add one request and step the engine until it is done; its step outputs, in order."""
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished():
        outs.extend(o for o in eng.step() if o.request_id == rid)
    return outs


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the log-distribution of the token at p + 1 (one plain transformers forward)."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_position(got: dict, ref: torch.Tensor, token: int, k: int) -> None:
    """`got` holds `token` and the k most likely alternatives of the reference distribution `ref`, with its
    values within 1e-4 (ties within that tolerance may pick either token)."""
    assert token in got
    others = [t for t in got if t != token]
    assert len(got) in (k, k + 1) and len(others) >= k - 1
    kth = ref.topk(k).values[-1].item() if k else float("inf")
    for t, value in got.items():
        assert abs(value - ref[t].item()) <= 1e-4, (t, value, ref[t].item())
        if t != token:
            assert ref[t].item() >= kth - 1e-4
    if token not in ref.topk(k).indices.tolist():
        assert len(others) == k


def _check_prompt_logprobs(prompt_logprobs, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        _check_position(prompt_logprobs[p], ref[p - 1], ids[p], k)


# ---- n > 1 --------------------------------------------------------------------------------------------------------

def test_greedy_n4_gives_four_identical_completions_equal_to_n1(llm, tokenizer, hf_model):
    prompt = "The capital of France is"
    ref = hf_greedy_one_at_a_time(hf_model, tokenizer, [prompt], 8)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = llm.generate(prompt, params)[0]
    four = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=4))[0]
    assert one.token_ids == ref
    assert [c.index for c in four.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == ref and c.text == one.text and c.finish_reason == "length" for c in four.outputs)
    assert four.token_ids == ref and four.text == one.text and four.finish_reason == "length"
    assert len(one.outputs) == 1 and one.outputs[0].token_ids == one.token_ids
    assert_no_leaks(llm)


def test_seeded_n4_is_reproducible_and_completion_0_is_the_n1_stream(llm):
    prompt = "Once upon a time,"
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True, n=4)
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    runs = [[c.token_ids for c in out.outputs] for out in (first, again)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4, "the completions drew the same stream"
    single = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True))[0]
    assert single.token_ids == runs[0][0]
    assert_no_leaks(llm)


def test_n_shares_the_prompts_full_blocks(any_llm, tokenizer):
    """A 52-token prompt has 3 full blocks short of its last token; with 8 tokens each of the 4 completions needs
    4 blocks. Shared, the request holds 3 + 4 * 1 = 7 blocks, not 4 * 4."""
    eng = any_llm.engine
    bs = eng.config.block_size
    assert bs == 16
    ids = _ids(tokenizer, 52, salt=f"{eng.config.enable_prefix_caching} ")
    records = record_steps(any_llm)
    n, max_tokens = 4, 8
    outs = _run(eng, "shared", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n))
    used = [r.kv_blocks_total - r.kv_blocks_free for r in records]
    shared = (len(ids) - 1) // bs
    per_seq = -(-(len(ids) + max_tokens - 1) // bs)
    assert shared == 3 and per_seq == 4
    assert max(used) == shared + n * (per_seq - shared) == 7
    assert max(used) < n * -(-len(ids) // bs)
    assert sum(len(o.new_token_ids) for o in outs) == n * max_tokens
    assert_no_leaks(any_llm)


def test_abort_mid_way_cancels_all_completions_and_frees_every_block(any_llm):
    eng = any_llm.engine
    eng.add_request("gone", TEXT, SamplingParams(max_tokens=50, temperature=0.8, seed=3, ignore_eos=True, n=3))
    outs = []
    while sum(1 for s in eng.scheduler.running if s.request_id == "gone" and s.num_output_tokens >= 2) < 3:
        assert len(outs) < 100, "the three completions never all ran"
        outs.extend(eng.step())
    assert eng.stats()["kv_blocks_free"] < eng.stats()["kv_blocks_total"]
    assert eng.abort("gone")
    while eng.has_unfinished():
        outs.extend(eng.step())
    ends = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.index for o in ends) == [0, 1, 2]
    assert all(o.finish_reason == "abort" for o in ends)
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert outs[-1].completion_tokens == sum(len(o.new_token_ids) for o in outs)
    assert_no_leaks(any_llm)


def test_usage_and_the_shape_of_the_stream(llm, tokenizer):
    eng = llm.engine
    ids = _ids(tokenizer, 30, salt="usage ")
    outs = _run(eng, "usage", ids, SamplingParams(max_tokens=5, temperature=0.7, seed=9, ignore_eos=True, n=3,
                                                 logprobs=2, prompt_logprobs=1))
    last = outs[-1]
    assert last.finished and not any(o.finished for o in outs[:-1])
    assert last.prompt_tokens == len(ids)  # once, not per completion
    assert last.completion_tokens == 15 == sum(len(o.new_token_ids) for o in outs)
    ends = [o for o in outs if o.finish_reason is not None]
    assert sorted(o.index for o in ends) == [0, 1, 2] and all(o.finish_reason == "length" for o in ends)
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids) for o in outs)
    assert_no_leaks(llm)


# ---- prompt log-probabilities -------------------------------------------------------------------------------------

def test_prompt_logprobs_match_transformers(llm, tokenizer, hf_model):
    ids = _ids(tokenizer, 40, salt="plain ")
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    _check_prompt_logprobs(out.prompt_logprobs, ids, _hf_logprobs(hf_model, ids), 3)
    assert out.logprobs is None and out.outputs[0].logprobs is None
    assert_no_leaks(llm)


def test_prompt_logprobs_across_chunked_prefill(plain_llm, tokenizer, hf_model):
    ids = _ids(tokenizer, 60, salt="chunks ")
    records = record_steps(plain_llm)
    out = plain_llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    assert sum(1 for r in records if r.prefill_tokens) >= 3  # 60 tokens through a 24-token budget
    _check_prompt_logprobs(out.prompt_logprobs, ids, _hf_logprobs(hf_model, ids), 3)
    assert_no_leaks(plain_llm)


def test_prompt_logprobs_of_a_prompt_in_the_prefix_cache_are_recomputed(llm, tokenizer, hf_model):
    ids = _ids(tokenizer, 50, salt="cached ")
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([ids], params)
    assert llm.generate([ids], params)[0].cached_tokens >= 48  # the prefix sits in the cache
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    assert out.cached_tokens == 0
    _check_prompt_logprobs(out.prompt_logprobs, ids, _hf_logprobs(hf_model, ids), 3)
    assert_no_leaks(llm)


@pytest.mark.parametrize("k", [0, 2])
def test_n2_with_prompt_logprobs(any_llm, tokenizer, hf_model, k):
    ids = _ids(tokenizer, 37, salt=f"pair {k} ")
    out = any_llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, n=2, prompt_logprobs=k))[0]
    _check_prompt_logprobs(out.prompt_logprobs, ids, _hf_logprobs(hf_model, ids), k)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert_no_leaks(any_llm)


@pytest.mark.parametrize("n", [1, 2])
def test_generated_token_logprobs_match_transformers(any_llm, tokenizer, hf_model, n):
    """Raw log-probabilities (k = 5) of every sampled token, penalties and temperature notwithstanding: transformers'
    log_softmax at the same positions of prompt + completion (teacher-forced), within 1e-4."""
    ids = _ids(tokenizer, 21, salt=f"sampled {n} ")
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=n, logprobs=5, repetition_penalty=1.3,
                            presence_penalty=0.5, ignore_eos=True)
    out = any_llm.generate([ids], params)[0]
    assert len(out.outputs) == n and out.logprobs == out.outputs[0].logprobs
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        ref = _hf_logprobs(hf_model, ids + completion.token_ids)
        for j, (token, got) in enumerate(zip(completion.token_ids, completion.logprobs)):
            _check_position(got, ref[len(ids) - 1 + j], token, 5)
    assert_no_leaks(any_llm)


# ---- intake checks and min_tokens ---------------------------------------------------------------------------------

def test_logit_bias_token_id_beyond_the_vocabulary_is_rejected(llm):
    eng = llm.engine
    vocab = eng.model_args.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("bias", "Hi", SamplingParams(logit_bias={vocab: 1.0}))
    assert "bias" not in eng.request_ids and eng.stats()["num_waiting"] == 0
    eng.add_request("bias", "Hi", SamplingParams(max_tokens=1, logit_bias={vocab - 1: 1.0}))
    while eng.has_unfinished():
        eng.step()


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    base = llm.generate(prompt, greedy)[0]
    first = base.token_ids[0]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first]))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first],
                                               min_tokens=3))[0]
    assert len(held.token_ids) > 3
    stop = base.text.strip()[:1]  # a string that appears in the first token's text
    assert stop and llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[stop]))[0].text == \
        base.text[:base.text.index(stop)]
    held = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop=[stop], min_tokens=3))[0]
    assert len(held.token_ids) > 3 and held.token_ids[:3] == base.token_ids[:3]
    assert_no_leaks(llm)


# ---- structured output wiring (a fake grammar: engine/structured.py provides the real one) -----------------------

class FakeMatcher:
    """Terminates after `length` accepted tokens; rejects token `reject` if given."""

    def __init__(self, length: int, reject: int | None, log: list) -> None:
        self.length, self.reject, self.accepted = length, reject, []
        log.append(self)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(-1)  # everything allowed

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return token != self.reject

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeCompiler:
    built: list = []

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None) -> None:
        FakeCompiler.built.append(vocab_size)
        self.matchers: list[FakeMatcher] = []
        self.reject: int | None = None

    def compile(self, params: StructuredOutputsParams):
        if params.regex == "(":
            raise ValueError("structured_outputs.regex is not a valid regular expression")
        return int(params.regex)

    def matcher(self, compiled: int) -> FakeMatcher:
        return FakeMatcher(compiled, self.reject, self.matchers)


@pytest.fixture
def fake_grammar(llm, monkeypatch):
    """engine.structured with a fake compiler (the real bitmask helpers, which the sampler uses), and a fresh
    (unbuilt) compiler slot on the engine."""
    from engine import structured

    FakeCompiler.built = []
    fake = types.SimpleNamespace(GrammarCompiler=FakeCompiler, allocate_bitmask=structured.allocate_bitmask,
                                 apply_bitmask=structured.apply_bitmask)
    monkeypatch.setitem(sys.modules, "engine.structured", fake)
    monkeypatch.setattr(llm.engine, "grammar_compiler", None)
    return llm


def test_structured_output_wiring(fake_grammar):
    llm = fake_grammar
    eng = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2,
                            structured_outputs=StructuredOutputsParams(regex="3"))
    out = llm.generate("Hello", params)[0]
    compiler = eng.grammar_compiler
    assert FakeCompiler.built == [eng.model_args.vocab_size]
    assert [c.finish_reason for c in out.outputs] == ["stop", "stop"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]  # stopped when the grammar terminated
    assert [m.accepted for m in compiler.matchers] == [c.token_ids for c in out.outputs]  # one matcher each
    with pytest.raises(ValueError, match="regex"):
        eng.add_request("bad", "Hello", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert "bad" not in eng.request_ids and eng.stats()["num_waiting"] == 0
    llm.generate("Hello", params)
    assert eng.grammar_compiler is compiler and len(FakeCompiler.built) == 1  # built once per engine
    assert_no_leaks(llm)


def test_a_token_the_grammar_rejects_fails_the_request_once(fake_grammar):
    llm = fake_grammar
    eng = llm.engine
    plain = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    eng._grammar_compiler().reject = plain.token_ids[1]
    outs = _run(eng, "rejected", "Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2,
                                                         structured_outputs=StructuredOutputsParams(regex="9")))
    errors = [o for o in outs if o.finish_reason == "error"]
    assert len(errors) == 1 and errors[0].finished and outs[-1] is errors[0] and "grammar" in errors[0].error
    assert_no_leaks(llm)


# ---- the fork itself, and n > 1 under preemption ------------------------------------------------------------------

def test_fork_prefix_takes_only_computed_full_blocks_of_an_equal_prefix(llm):
    from engine.request import Sequence

    kv = llm.engine.kv
    bs = kv.block_size

    def seq(ids: list[int]) -> Sequence:
        return Sequence(request_id="f", token_ids=list(ids), num_prompt_tokens=len(ids), params=SamplingParams(),
                        arrival=0, arrival_time=0.0)

    src = seq(list(range(3 * bs + 5)))
    src.block_table, src.block_hashes, src.num_computed_tokens = [7, 8, 9, 10], [1, 2, 3], 3 * bs + 5
    prefix = kv.fork_prefix(src, seq(src.token_ids))
    assert prefix.blocks == (7, 8, 9) and prefix.num_tokens == 3 * bs
    short = seq(src.token_ids[:3 * bs])  # its last token must be computed by itself: two blocks only
    assert kv.fork_prefix(src, short).blocks == (7, 8)
    other = seq([1] + src.token_ids[1:])
    assert kv.fork_prefix(src, other).num_tokens == 0  # different tokens: nothing shared
    src.num_computed_tokens = bs + 3  # still prefilling: only what it computed
    assert kv.fork_prefix(src, seq(src.token_ids)).blocks == (7,)


def test_n4_under_preemption_matches_transformers(tokenizer, hf_model):
    """A pool too small for four 64-token completions: they preempt one another and recompute, and still give
    transformers' greedy tokens, then free everything."""
    llm = make_llm(num_kv_blocks=9, enable_prefix_caching=False)
    records = record_steps(llm)
    ids = _ids(tokenizer, 40, salt="tight ")
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=4))[0]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)[0, 40:]
    assert sum(r.preempted for r in records) > 0
    assert all(c.token_ids == ref.tolist() for c in out.outputs)
    assert_no_leaks(llm)


def test_unset_max_tokens_is_the_rest_of_the_context():
    """max_tokens=None (a request that set none, through either door): the generation may fill what is left of the
    context, as vLLM fills it in; a max_tokens set too large is still refused, never clamped."""
    llm = make_llm(max_model_len=40, num_kv_blocks=8)
    prompt = "The capital of France is"
    n = len(llm.engine.tokenizer(prompt).input_ids)
    out = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 - n and out.finish_reason == "length"
    with pytest.raises(ValueError, match=f"max_tokens is too large: 40; .* at most {40 - n}"):
        llm.generate(prompt, SamplingParams(max_tokens=40))
