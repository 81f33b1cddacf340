"""Gemma 3 270M Q4_K_M (a real GGUF file from PyPI: Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors; 15 of 18 layers with a
512-token sliding window) through `LLM`, against transformers on the same file (tests/gemma.py)."""
from __future__ import annotations

import logging

import pytest

from engine import LLM, EngineConfig, SamplingParams
from kernels import quant
from tests.engine.conftest import assert_no_leaks, record_steps
from tests.gemma import MAX_TOKENS, check_greedy

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# The most a prompt logprob moves from transformers' float32 one with bf16 wide steps (x and the weights rounded to
# bf16 in prefill chunks past the int8 kernel's width): measured 0.042 and 0.034 on the two long prompts (a 2-core
# Xeon with AMX, 2026-12-02); about 5x that.
BF16_LOGPROB = 0.2


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf) -> LLM:
    """The file as a user starts it, with no chat template; what the engine logged while it started is kept in
    `startup_log`."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tandem.engine")
    logger.addHandler(handler)
    try:
        llm = LLM(EngineConfig(model=str(gemma_gguf)))
    finally:
        logger.removeHandler(handler)
    llm.startup_log = [r.getMessage() for r in records]
    return llm


def test_the_file_is_served_from_its_blocks(gemma_llm) -> None:
    info = gemma_llm.engine.model_info()
    assert info["architecture"] == "Gemma3ForCausalLM" and info["quantization"] == "gguf"
    assert info["weight_format"].startswith("gguf Q4_K + Q5_0 + Q6_K + Q8_0")
    assert info["weight_bytes"] < 260e6  # the file is 253 MB; dense float32 would be over 1 GB
    args = gemma_llm.engine.model_args
    assert args.layer_windows.count(512) == 15 and args.layer_windows.count(0) == 3


def test_greedy_and_prompt_logprobs_match_transformers(gemma_gguf, gemma_prompts, gemma_reference) -> None:
    # float32 activations: this asks for transformers' tokens up to summation order (check_greedy); the default
    # rounds the K-quants' activations to int8 in every step of up to small_m rows (16: all 16 prompts decode that
    # way), which moves near-ties (three of 16 continuations differ under it on the avx512 path).
    llm = LLM(EngineConfig(model=str(gemma_gguf), cpu_activations="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(gemma_prompts, params)
    assert [o.prompt_token_ids for o in outs] == gemma_reference.prompt_ids
    assert max(len(ids) for ids in gemma_reference.prompt_ids) > 512 + MAX_TOKENS  # the window is exercised
    check_greedy([o.token_ids for o in outs], gemma_reference.greedy)
    for out, ref in zip(outs, gemma_reference.prompt_logprobs):
        ours = [lp[t] for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        assert len(ours) == len(ref)
        assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-3
    assert_no_leaks(llm)


def test_still_identical_under_kv_pressure_with_preemption(gemma_gguf, gemma_prompts, gemma_reference) -> None:
    # The two long prompts (past the window) and six short ones on 64 blocks of 16 tokens: the longest prompt and
    # its continuation fit (47 blocks), all eight together do not, so sequences are preempted and recomputed.
    # float32 activations: this checks that preemption and recompute leave the tokens as transformers' up to
    # summation order (check_greedy), which the default's int8 rounding of the K-quants' activations at decode
    # (cpu_activations "auto") does not promise: it moves near-ties (it failed this check under "auto").
    chosen = [0, 1, 2, 3, 4, 5, 14, 15]
    llm = LLM(EngineConfig(model=str(gemma_gguf), num_kv_blocks=64, enable_prefix_caching=False,
                           cpu_activations="float32"))
    records = record_steps(llm)
    outs = llm.generate([gemma_prompts[i] for i in chosen], GREEDY)
    check_greedy([o.token_ids for o in outs], [gemma_reference.greedy[i] for i in chosen])
    assert sum(r.preempted for r in records) > 0
    assert_no_leaks(llm)


def test_aborts_and_reranks_under_kv_pressure_leak_nothing(gemma_gguf, gemma_prompts) -> None:
    """A small pool shared by generations past the window, a rerank job and two aborts (one request after its first
    step, one while it decodes): every KV block comes back and nothing is left running."""
    llm = LLM(EngineConfig(model=str(gemma_gguf), num_kv_blocks=64, max_num_batched_tokens=256))
    eng = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in (14, 15, 0, 3):
        eng.add_request(f"g{i}", gemma_prompts[i], params)
    eng.add_rerank("rr", "lighthouse keeper", ["The keeper lit the lamp.", "Bananas are yellow.", gemma_prompts[14]])
    outs = eng.step()
    assert eng.abort("g3")  # waiting or mid-prefill behind the long prompts
    while not any(o.request_id == "g0" and o.new_token_ids for o in outs):
        outs += eng.step()
    assert eng.abort("g0")  # decoding
    while eng.has_unfinished():
        outs += eng.step()
    finals = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert finals["g14"] == finals["g15"] == "length" and finals["g0"] == finals["g3"] == "abort" and "rr" in finals
    assert_no_leaks(llm)


def test_chat_on_a_base_model_without_template_is_a_clear_error(gemma_llm) -> None:
    """Start-up says the file has no template and which shipped one to pass; a chat's error names the flag."""
    said = [m for m in gemma_llm.startup_log if "no chat template" in m]
    assert said and "--chat-template gemma" in said[0], gemma_llm.startup_log
    with pytest.raises(ValueError, match="this model has no chat template.*--chat-template NAME \\(gemma, llama3"):
        gemma_llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
    assert_no_leaks(gemma_llm)


@pytest.mark.skipif(not quant.bf16_gemm_available(quant.CpuIsa.AVX512) or quant.best_isa() < quant.CpuIsa.AVX512,
                    reason="this CPU has no native bf16 GEMM on an AVX-512 path (AVX512_BF16 or AMX): wide steps stay "
                    "float32 here")
def test_bf16_wide_steps_keep_prompt_logprobs_near_transformers(gemma_gguf, gemma_prompts, gemma_reference,
                                                                 monkeypatch) -> None:
    """The default on a CPU with native bf16 (the suite turns it off, tests/conftest.py): the K-quants' prefill
    chunks past the int8 kernel's width multiply bf16 (ModelInfo says so), and the long prompts' logprobs, whose
    chunks are that wide, stay within BF16_LOGPROB of transformers' float32 ones, and past the 1e-3 that float32
    steps hold (test_greedy_and_prompt_logprobs_match_transformers): the bf16 path ran."""
    monkeypatch.setenv("TANDEM_NATIVE_BF16", "1")
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)  # the default path, also in a run that forces a narrower one
    long = [i for i, ids in enumerate(gemma_reference.prompt_ids) if len(ids) > 256]
    llm = LLM(EngineConfig(model=str(gemma_gguf)))
    assert llm.engine.model_info()["cpu_kernels"].endswith(" bf16-wide")
    outs = llm.generate([gemma_prompts[i] for i in long], SamplingParams(max_tokens=1, temperature=0.0,
                                                                         prompt_logprobs=0))
    errors = [max(abs(lp[t] - r) for lp, t, r in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:],
                                                      gemma_reference.prompt_logprobs[i]))
              for out, i in zip(outs, long)]
    assert long and max(errors) <= BF16_LOGPROB and min(errors) > 1e-3, errors
    assert_no_leaks(llm)
