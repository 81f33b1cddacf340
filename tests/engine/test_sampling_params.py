"""The #20 sampler parameters against references written by others: transformers' logits processors
(RepetitionPenalty, MinP, MinNewTokensLength, SequenceBias), OpenAI's documented presence/frequency formula,
torch's log_softmax / topk; on random logits and on real logits of the embedded model, in batches that mix rows
with different settings and rows that set nothing (those must stay exactly on the old path)."""
from __future__ import annotations

import collections
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from engine.config import SamplingParams
from engine.logits_processors import SamplingContext, apply_processors
from engine.request import Sequence
from engine.runner import ModelRunner
from engine.sampling import _min_p, sample, sample_sequences
from engine.scheduler import Batch

NEG_INF = float("-inf")
V = 300  # random-logit vocabulary: several bitmask words, fast


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int, vocab: int = V, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=gen(seed)) * scale


def histories(rows: int, seed: int, prompt: int = 12, output: int = 9, vocab: int = V) -> list[list[int]]:
    """Token lists with repeats (drawn from a small range), so counts above one occur."""
    g = gen(seed)
    return [torch.randint(0, vocab // 4, (prompt + output,), generator=g).tolist() for _ in range(rows)]


def context(token_ids: list[list[int]], num_prompt: int | list[int], eos=(), grammars=None) -> SamplingContext:
    prompts = num_prompt if isinstance(num_prompt, list) else [num_prompt] * len(token_ids)
    return SamplingContext(token_ids=token_ids, num_prompt_tokens=prompts, eos_token_ids=frozenset(eos),
                           grammars=grammars)


def processed(logits: torch.Tensor, params: list[SamplingParams], ctx: SamplingContext | None) -> torch.Tensor:
    out = logits.clone()
    apply_processors(out, params, ctx)
    return out


def openai_penalties(row: torch.Tensor, outputs: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's API reference: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = row.clone()
    for token, count in collections.Counter(outputs).items():
        out[token] = out[token] - count * frequency - float(count > 0) * presence
    return out


@pytest.fixture(scope="module")
def real(hf_model, tokenizer):
    """(logits [rows, V], histories): the embedded model's next-token logits after each of a chat prompt's last
    positions, each row's history being the prompt up to it (prompt + "generated" tokens)."""
    msgs = [{"role": "user", "content": "List three fruits, then three fruits again, then three more fruits."}]
    ids = tokenizer(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)).input_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    rows = list(range(len(ids) - 6, len(ids)))
    return logits[rows].contiguous(), [ids[:r + 1] for r in rows]


# ---- each processor against its reference ------------------------------------------------------------------


@pytest.mark.parametrize("source", ["random", "real"])
def test_repetition_penalty_matches_transformers(source, real):
    logits, hist = (random_logits(6, 0), histories(6, 0)) if source == "random" else real
    penalties = [1.3, 1.0, 0.7, 2.0, 1.0, 1.05]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    out = processed(logits, params, context(hist, 5))
    for r, p in enumerate(penalties):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([hist[r]]), logits[r:r + 1].clone())[0]
        torch.testing.assert_close(out[r], ref, rtol=0, atol=1e-6)
        if p == 1.0:
            assert torch.equal(out[r], logits[r])  # untouched: bit for bit
    assert not torch.equal(out[0], logits[0])  # the reference changed something


@pytest.mark.parametrize("source", ["random", "real"])
def test_presence_and_frequency_follow_openai_over_generated_tokens_only(source, real):
    logits, hist = (random_logits(5, 1), histories(5, 1)) if source == "random" else real
    num_prompt = [len(h) - 4 for h in hist]  # the last 4 tokens of each row are its "generated" ones
    settings = [(0.5, 0.5), (0.0, 1.5), (-0.7, 0.0), (0.0, 0.0), (2.0, -2.0)]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in settings]
    out = processed(logits, params, context(hist, num_prompt))
    for r, (f, p) in enumerate(settings):
        ref = openai_penalties(logits[r], hist[r][num_prompt[r]:], f, p)
        torch.testing.assert_close(out[r], ref, rtol=0, atol=1e-5)
    assert torch.equal(out[3], logits[3])
    # a prompt-only token is not penalised
    prompt_only = set(hist[0][:num_prompt[0]]) - set(hist[0][num_prompt[0]:])
    assert all(out[0, t] == logits[0, t] for t in prompt_only)


def test_all_penalties_together_apply_repetition_first(real):
    logits, hist = real
    num_prompt = [len(h) - 5 for h in hist]
    params = [SamplingParams(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)] * len(hist)
    out = processed(logits, params, context(hist, num_prompt))
    for r in range(len(hist)):
        rep = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([hist[r]]), logits[r:r + 1].clone())[0]
        torch.testing.assert_close(out[r], openai_penalties(rep, hist[r][num_prompt[r]:], 0.3, 0.4),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("source", ["random", "real"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_min_p_matches_transformers(source, temperature, real):
    logits = random_logits(4, 2, scale=2.0) if source == "random" else real[0][:4]
    min_ps = [0.05, 0.0, 0.3, 1.0]
    scaled = logits / temperature
    ours = _min_p(scaled.softmax(-1), min_ps)
    for r, m in enumerate(min_ps):
        ref = MinPLogitsWarper(m)(None, scaled[r:r + 1].clone()).softmax(-1)[0] if m else scaled[r].softmax(-1)
        torch.testing.assert_close(ours[r], ref, rtol=0, atol=1e-6)
    if source == "random":  # real next-token distributions here are often peaked: one token is all min_p keeps
        assert (ours[2] > 0).sum() < (ours[0] > 0).sum() < logits.shape[-1]


def test_sampling_with_min_p_draws_only_tokens_the_warper_keeps():
    logits = random_logits(1, 3, scale=1.5)
    keep = MinPLogitsWarper(0.2)(None, logits.clone())[0] > NEG_INF
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=0)
    g = gen(0)
    seen = {sample(logits.clone(), [p], [g])[0] for _ in range(300)}
    assert seen <= set(keep.nonzero().squeeze(-1).tolist()) and len(seen) > 1


def test_min_p_then_top_p_renormalises_over_what_min_p_left():
    # probs [0.4, 0.3, 0.2, 0.1]: min_p 0.4 drops 0.1 (< 0.16); of [0.4, 0.3, 0.2] / 0.9, top_p 0.7 needs
    # 0.444 + 0.333 = 0.78 -> two tokens (without renormalising, 0.4 + 0.3 = 0.7 would not reach it: three).
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    p = SamplingParams(temperature=1.0, min_p=0.4, top_p=0.7, seed=0)
    g = gen(0)
    assert {sample(logits.clone(), [p], [g])[0] for _ in range(300)} == {0, 1}


def test_min_tokens_matches_transformers_then_stops_masking():
    eos, stops = 7, [3, 11]
    logits = random_logits(1, 4)
    params = SamplingParams(min_tokens=3, stop_token_ids=stops, max_tokens=10)
    prompt = [1, 2, 5, 9]
    masked_steps = 0
    for generated in range(6):
        hist = prompt + [20] * generated
        out = processed(logits, [params], context([hist], len(prompt), eos=[eos]))
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [eos] + stops)(torch.tensor([hist]), logits.clone())
        assert torch.equal(out, ref)
        masked_steps += bool(out[0, eos] == NEG_INF)
    assert masked_steps == 3
    ignoring = SamplingParams(min_tokens=3, stop_token_ids=stops, ignore_eos=True)
    out = processed(logits, [ignoring], context([prompt], len(prompt), eos=[eos]))
    assert out[0, eos] == logits[0, eos] and (out[0, stops] == NEG_INF).all()


def test_min_tokens_keeps_a_greedy_row_off_eos_until_reached():
    eos = 5
    logits = torch.zeros(1, 20)
    logits[0, eos], logits[0, 9] = 10.0, 8.0  # EOS is the argmax, then 9
    p = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5)
    picks = [sample(logits.clone(), [p], [None], context([[1] + [9] * n], 1, eos=[eos]))[0] for n in range(4)]
    assert picks == [9, 9, eos, eos]


def test_logit_bias_matches_sequence_bias_and_plain_addition(real):
    logits = real[0][:3]
    biases = [{5: 100.0, 17: -100.0, 300: 3.5}, None, {17: 0.25}]
    params = [SamplingParams(logit_bias=b) for b in biases]
    out = processed(logits, params, None)
    for r, b in enumerate(biases):
        if not b:
            assert torch.equal(out[r], logits[r])
            continue
        ref = SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])(torch.tensor([[1, 2]]),
                                                                             logits[r:r + 1].clone())[0]
        plain = logits[r].clone()
        plain[list(b)] += torch.tensor(list(b.values()))
        torch.testing.assert_close(out[r], ref, rtol=0, atol=0)
        torch.testing.assert_close(out[r], plain, rtol=0, atol=0)
    assert int(out[0].argmax()) == 5


def test_logit_bias_ignores_ids_beyond_the_vocabulary():
    logits = random_logits(1, 5)
    out = processed(logits, [SamplingParams(logit_bias={V + 10: 5.0, 1: 1.0})], None)
    assert out[0, 1] == logits[0, 1] + 1.0 and torch.equal(out[0, 2:], logits[0, 2:])


def test_processors_needing_tokens_refuse_to_run_without_a_context():
    with pytest.raises(ValueError, match="SamplingContext"):
        apply_processors(random_logits(1, 0), [SamplingParams(presence_penalty=1.0)], None)


# ---- mixed batches -----------------------------------------------------------------------------------------


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, seed=1),  # untouched, sampled
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5, seed=2),
        SamplingParams(temperature=0.0),  # untouched, greedy
        SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=1.0, logit_bias={3: 2.0}, seed=4),
        SamplingParams(temperature=0.7, top_k=20, seed=5),  # untouched, candidates path
        SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=4, stop_token_ids=[9]),
    ]


def test_untouched_rows_keep_their_logits_and_old_path_draws():
    logits, hist = random_logits(6, 6), histories(6, 6)
    params = _mixed_params()
    untouched = [0, 2, 4]
    ctx = context(hist, 12, eos=[0])
    out = processed(logits, params, ctx)
    for r in untouched:
        assert torch.equal(out[r], logits[r])
    for r in (1, 3, 5):
        assert not torch.equal(out[r], logits[r])
    for step in range(5):
        mixed = sample(logits.clone(), params, [gen(10 * step + r) for r in range(6)], ctx)
        alone = sample(logits[untouched].clone(), [params[r] for r in untouched],
                       [gen(10 * step + r) for r in untouched])
        assert [mixed[r] for r in untouched] == alone


def test_seeded_rows_with_processors_are_reproducible_and_independent_of_neighbours():
    logits, hist = random_logits(6, 7, scale=1.0), histories(6, 7)
    params = _mixed_params()
    ctx = context(hist, 12)
    runs = []
    for _ in range(2):
        gens = [gen(100 + r) for r in range(6)]
        runs.append([sample(logits.clone(), params, gens, ctx) for _ in range(6)])
    assert runs[0] == runs[1]
    for r in (1, 3):  # each sampled, processed row alone, its own generator
        g = gen(100 + r)
        alone = [sample(logits[r:r + 1].clone(), [params[r]], [g], context([hist[r]], 12))[0] for _ in range(6)]
        assert alone == [step[r] for step in runs[0]]
        assert len(set(alone)) > 1


def test_greedy_row_with_repetition_penalty_picks_the_penalised_argmax(real):
    logits, hist = real
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.8)] * len(hist)
    ref = RepetitionPenaltyLogitsProcessor(1.8)
    picks = sample(logits.clone(), params, [None] * len(hist), context(hist, 5))
    expected = [int(ref(torch.tensor([h]), logits[r:r + 1].clone()).argmax()) for r, h in enumerate(hist)]
    assert picks == expected
    assert picks != logits.argmax(-1).tolist()  # the penalty mattered on these logits


# ---- raw log-probabilities ---------------------------------------------------------------------------------


def _seq(params: SamplingParams, tokens: list[int], num_prompt: int, seed: int | None = None, grammar=None):
    return SimpleNamespace(params=params, token_ids=tokens, num_prompt_tokens=num_prompt, grammar=grammar,
                           generator=gen(seed) if seed is not None else None)


@pytest.mark.parametrize("source", ["random", "real"])
def test_logprobs_are_raw_log_softmax_with_the_right_top_k(source, real):
    logits, hist = (random_logits(6, 8), histories(6, 8)) if source == "random" else real
    settings = [dict(logprobs=5, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=1),
                dict(logprobs=0, temperature=0.0, presence_penalty=1.0), dict(), dict(logprobs=20, temperature=1.5,
                seed=2), dict(logprobs=3, logit_bias={1: -50.0}), dict(logprobs=None, repetition_penalty=2.0)]
    seqs = []
    for r, s in enumerate(settings):
        seed = s.pop("seed", None)
        seqs.append(_seq(SamplingParams(**s), hist[r], len(hist[r]) - 3, seed))
    raw = logits.log_softmax(-1)
    out = sample_sequences(logits.clone(), seqs, eos_token_ids=[0])
    for r, seq in enumerate(seqs):
        k = seq.params.logprobs
        if k is None:
            assert out.logprobs[r] is None
            continue
        lp = out.logprobs[r]
        token = out.tokens[r]
        assert abs(lp[token] - raw[r, token].item()) <= 1e-5
        top = set(torch.topk(raw[r], k).indices.tolist())
        assert set(lp) == top | {token}
        for t, v in lp.items():
            assert abs(v - raw[r, t].item()) <= 1e-5
    assert set(out.logprobs[1]) == {out.tokens[1]}  # k = 0: the chosen token only


# ---- structured-output mask --------------------------------------------------------------------------------


class FakeMatcher:
    """Allows a fixed set of tokens, filling xgrammar's layout: bit t % 32 of word t // 32."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[-1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _fake_structured_module() -> types.ModuleType:
    module = types.ModuleType("engine.structured")

    def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
        return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)

    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]].bool()
        logits.masked_fill_(~allowed, NEG_INF)

    module.allocate_bitmask, module.apply_bitmask = allocate_bitmask, apply_bitmask
    return module


@pytest.fixture
def structured(monkeypatch):
    """engine.structured when the structured-output branch is there; else a stand-in with its interface."""
    try:
        import engine.structured  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "engine.structured", _fake_structured_module())


def test_grammar_rows_draw_only_allowed_tokens_and_other_rows_are_untouched(structured):
    logits, hist = random_logits(4, 9, scale=0.5), histories(4, 9)
    allowed = [{31, 32, 63, 64, 250}, None, {0, 299}, None]
    grammars = [FakeMatcher(a) if a else None for a in allowed]
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    ctx = context(hist, 12, grammars=grammars)
    out = processed(logits, params, ctx)
    assert torch.equal(out[1], logits[1])
    for r in (0, 2):
        assert set((out[r] > NEG_INF).nonzero().squeeze(-1).tolist()) == allowed[r]
    gens = [gen(1), gen(2), None, None]
    draws = [sample(logits.clone(), params, gens, ctx) for _ in range(60)]
    assert {d[0] for d in draws} <= allowed[0] and len({d[0] for d in draws}) > 1
    assert {d[2] for d in draws} == {max(allowed[2], key=lambda t: logits[2, t].item())}


# ---- runner: logprobs per sampled row, prompt top-k, chunked -----------------------------------------------


@dataclass(slots=True)
class PromptLogprobs:
    """What the engine accumulates on a request from the runner's outputs (Generation.prompt_logprobs / _top_)."""
    values: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)


def _run_prompt(llm, ids: list[int], params: SamplingParams, chunks: list[int], k: int | None):
    eng = llm.engine
    seq = Sequence(request_id="lp", token_ids=list(ids), num_prompt_tokens=len(ids), params=params,
                   arrival=0, arrival_time=0.0, logprob_start=1 if k is not None else None, num_prompt_logprobs=k)
    got = PromptLogprobs()
    assert eng.kv.allocate(seq, len(ids))
    try:
        for n in chunks:
            batch = Batch()
            batch.add(seq, n)
            out = eng.runner.run(batch, eng.staged)
            # The runner returns a row's prompt log-probabilities in its output; the engine appends them to the
            # request (as here) and the scheduler advances the sequence.
            got.values.extend(out.prompt_logprobs[0] or [])
            got.tops.extend(out.prompt_top_logprobs[0] or [])
            seq.num_computed_tokens += n
    finally:
        eng.kv.free(seq)
    return got, out


def test_runner_prompt_top_logprobs_across_chunks_match_transformers(llm, hf_model, tokenizer, monkeypatch):
    monkeypatch.setattr(ModelRunner, "LOGPROB_CHUNK", 4)  # several LM-head chunks per step
    ids = tokenizer("The quick brown fox jumps over the lazy dog because it").input_ids
    got, _ = _run_prompt(llm, ids, SamplingParams(temperature=0.0), [5, len(ids) - 5], k=3)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert len(got.tops) == len(got.values) == len(ids) - 1
    for pos, (value, top) in enumerate(zip(got.values, got.tops)):
        token = ids[pos + 1]
        assert top[token] == value  # the float list is unchanged and agrees
        assert abs(value - ref[pos, token].item()) <= 2e-3
        best = set(sorted(top, key=top.get, reverse=True)[:3])  # the alternatives; the token may be among them
        assert len(top) == (3 if token in best else 4)
        for t, v in top.items():
            assert abs(v - ref[pos, t].item()) <= 2e-3
        # the alternatives are transformers' top 3 (up to a swap with a token within the tolerance of the 3rd)
        third = torch.topk(ref[pos], 3).values[-1].item()
        assert all(ref[pos, t].item() >= third - 4e-3 for t in best)
        assert all(t in best for t in torch.topk(ref[pos], 3).indices.tolist() if ref[pos, t] > third + 4e-3)


def test_runner_returns_raw_logprobs_of_the_penalised_greedy_pick(llm, hf_model, tokenizer):
    ids = tokenizer("one two three one two three one two").input_ids
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=4)
    got, out = _run_prompt(llm, ids, params, [len(ids)], k=None)
    with torch.inference_mode():
        last = hf_model(torch.tensor([ids])).logits[0, -1:].float()
    penalised = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([ids]), last.clone())[0]
    assert out.sampled[0] == int(penalised.argmax())
    raw = last[0].log_softmax(-1)
    lp = out.logprobs[0]
    assert set(lp) == set(torch.topk(raw, 4).indices.tolist()) | {out.sampled[0]}
    for t, v in lp.items():
        assert abs(v - raw[t].item()) <= 2e-3
    assert got.values == [] and out.prompt_logprobs == [None]
