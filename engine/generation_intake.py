"""A generation's intake: its spec checked and tokenized into its job (n completions over one prompt), on any thread.
Registered in engine/kinds.py; reads the engine's fixed parts through the RequestIntake it is given."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

import torch
import xxhash

from engine.config import SamplingParams
from engine.detokenizer import TextStream
from engine.generation import Generation
from engine.request import Sequence
from engine.specs import GenerateSpec

if TYPE_CHECKING:
    from engine.intake import RequestIntake


def build(intake: "RequestIntake", spec: GenerateSpec) -> Generation:
    """n sequences over the same prompt. Completion 0 prefills it; the others wait for that and share its full
    blocks. With prompt_logprobs, completion 0 scores every prompt position from 1 on, so a prefix the cache
    holds is recomputed for it (a cached position has no logits), never refused."""
    request_id = spec.request_id
    params = spec.params if spec.params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError("params must be a SamplingParams")
    token_ids = intake.prompt_token_ids(spec.prompt, spec.messages, spec.tools)
    if (spec.chat or spec.messages is not None) and not params.ignore_eos:
        params = _stop_at_end_of_turn(intake, params)
    if len(token_ids) >= intake.max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is {intake.max_model_len} "
                         "(prompt plus at least one generated token must fit)")
    if params.max_tokens is None:  # unset: what is left of the context (vLLM's default)
        params = dataclasses.replace(params, max_tokens=intake.max_model_len - len(token_ids))
    if len(token_ids) + params.max_tokens > intake.max_model_len:  # refused, as vLLM does, never clamped
        raise ValueError(f"max_tokens is too large: {params.max_tokens}; the prompt has {len(token_ids)} tokens "
                         f"and max_model_len is {intake.max_model_len}, so max_tokens can be at most "
                         f"{intake.max_model_len - len(token_ids)}")
    _check_token_params(intake, params)
    grammar = _grammar(intake, params)  # compiled before anything is built: a bad schema queues nothing
    arrival_time = time.monotonic()
    seqs: list[Sequence] = []
    for i in range(params.n):
        seq = Sequence(request_id=request_id, token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                       params=params, arrival=next(intake.arrivals), arrival_time=arrival_time,
                       priority=params.priority, index=i, fork_of=seqs[0] if seqs else None,
                       generator=_generator(params.seed, i), grammar=grammar() if grammar else None)
        seqs.append(seq)
    if params.prompt_logprobs is not None:
        seqs[0].logprob_start = 1
        seqs[0].num_prompt_logprobs = params.prompt_logprobs
    streams = [TextStream(intake.tokenizer, params.stop, params.min_tokens, params.skip_special_tokens)
               for _ in seqs]
    return Generation(request_id, seqs, streams, finish_reasons=[None] * params.n)

def _stop_at_end_of_turn(intake: "RequestIntake", params: SamplingParams) -> SamplingParams:
    """A chat's params with the template's end-of-turn ids among its stop ids (masked under min_tokens and left
    out with ignore_eos, as EOS is), as llama.cpp ends generation at a template's end-of-generation tokens."""
    extra = [t for t in intake.end_of_turn_ids if t not in params.stop_token_ids]
    if not extra:
        return params
    return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

def _check_token_params(intake: "RequestIntake", params: SamplingParams) -> None:
    vocab = intake.vocab_size
    if params.logit_bias and any(t >= vocab for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")

def _grammar(intake: "RequestIntake", params: SamplingParams) -> "Callable[[], object] | None":
    """A factory of fresh matchers (one per completion) for the request's compiled grammar; None: no grammar."""
    if params.structured_outputs is None:
        return None
    if intake.grammar_compiler is None:
        raise ValueError("structured_outputs is not supported by this engine")
    compiler = intake.grammar_compiler()
    compiled = compiler.compile(params.structured_outputs)
    return lambda: compiler.matcher(compiled)


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """Completion 0 draws from the request's seed itself (so n = 1 is what it always was); completion i > 0 from a
    seed derived from (seed, i), so a seeded request is reproducible and its completions differ."""
    if seed is None:
        return None
    if index == 0:
        return torch.Generator().manual_seed(seed)
    return torch.Generator().manual_seed(xxhash.xxh64_intdigest(f"{seed}/{index}".encode()))
