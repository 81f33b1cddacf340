"""Sampling keywords of generate() -> a tandem.v1.SamplingParams message (vLLM's names; proto/tandem.proto
documents each field's meaning, default and bad values). The server validates values; this only shapes them."""
from __future__ import annotations

import json
from typing import Mapping, Sequence

from proto import tandem_pb2 as pb


def sampling_params(*, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                    stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, priority: int = 0,
                    n: int | None = None, logprobs: int | None = None, prompt_logprobs: int | None = None,
                    repetition_penalty: float | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, min_p: float | None = None,
                    min_tokens: int | None = None, logit_bias: Mapping[int, float] | None = None,
                    json_schema: dict | str | None = None, regex: str | None = None,
                    choice: Sequence[str] | None = None) -> pb.SamplingParams:
    """None (or an empty sequence) leaves a field unset: the server's default applies.

    n: completions of the prompt (deltas carry .index); logprobs / prompt_logprobs: alternatives per position
    (0: the chosen token only); logit_bias: token id -> added to its logit; json_schema (a dict or its JSON text),
    regex, choice: constrain the output (at most one of the three).
    """
    if stop is None or isinstance(stop, str):  # a lone string is one stop string, not its characters
        stop = [stop] if stop else []
    optional = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                    logprobs=logprobs, prompt_logprobs=prompt_logprobs, repetition_penalty=repetition_penalty,
                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, min_p=min_p,
                    min_tokens=min_tokens)
    msg = pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids or ()), ignore_eos=ignore_eos,
                            priority=priority, **{k: v for k, v in optional.items() if v is not None})
    if logit_bias:
        msg.logit_bias.update({int(token): float(bias) for token, bias in logit_bias.items()})
    _response_format(msg, json_schema, regex, choice)
    return msg


def _response_format(msg: pb.SamplingParams, json_schema: dict | str | None, regex: str | None,
                     choice: Sequence[str] | None) -> None:
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex, choice (got {', '.join(given)})")
    if json_schema is not None:
        msg.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif regex is not None:
        msg.regex = regex
    elif choice is not None:
        if isinstance(choice, str):
            raise ValueError("choice must be a list of strings, not one string")
        msg.choice.choices.extend(choice)
        msg.choice.SetInParent()  # an empty list still selects `choice`, so the server can refuse it
