"""Protobuf messages to engine arguments and engine outputs to protobuf messages."""
from __future__ import annotations

import json
from typing import Any

from engine import RerankParams, SamplingParams
from engine.config import StructuredOutputsParams
from engine.outputs import Logprobs, StepOutput, rank_scores
from proto import tandem_pb2 as pb
from service.errors import ServiceError, invalid
from service.lifecycle import RequestLifecycle

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
# Fields with presence: unset takes the engine's default, so 0 can be refused where it is not a valid value.
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "logprobs", "prompt_logprobs",
                      "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens")


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams; whatever it refuses is INVALID_ARGUMENT with its message (naming the field)."""
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    try:
        return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                              ignore_eos=msg.ignore_eos, priority=msg.priority,
                              logit_bias=dict(msg.logit_bias) or None,
                              structured_outputs=structured_outputs(msg), **kwargs)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def structured_outputs(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The response_format oneof; a json_schema that is not a JSON object is refused here, before the engine."""
    which = msg.WhichOneof("response_format")
    if which == "json_schema":
        return StructuredOutputsParams(json=_json_schema(msg.json_schema))
    if which == "regex":
        return StructuredOutputsParams(regex=msg.regex)
    if which == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    return None


def _json_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise ValueError(f"response_format.json_schema is not valid JSON: {_short(str(exc))}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema must be a JSON object (a schema), got {type(schema).__name__}")
    return schema


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def generate_input(req: pb.GenerateRequest) -> dict[str, Any]:
    """The engine's prompt/messages keyword for a request's input oneof."""
    which = req.WhichOneof("input")
    if which == "prompt":
        return {"prompt": req.prompt}
    if which == "token_ids":
        return {"prompt": list(req.token_ids.ids)}
    if which == "messages":
        for i, m in enumerate(req.messages.messages):
            if not m.role:
                raise invalid(f"messages[{i}].role must not be empty (e.g. 'system', 'user', 'assistant')")
        return {"messages": [{"role": m.role, "content": m.content} for m in req.messages.messages]}
    raise invalid("request has no input: set prompt, messages or token_ids")


def rerank_params(req: pb.RerankRequest) -> RerankParams:
    try:
        return RerankParams(top_n=req.top_n if req.HasField("top_n") else None,
                            truncate="none" if req.truncate == pb.TRUNCATE_NONE else "end",
                            return_documents=req.return_documents,
                            instruction=req.instruction if req.HasField("instruction") else None,
                            priority=req.priority)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def usage(lc: RequestLifecycle) -> pb.Usage:
    return pb.Usage(prompt_tokens=lc.prompt_tokens, cached_tokens=lc.cached_tokens,
                    completion_tokens=lc.completion_tokens, time_to_first_token_s=lc.ttft_s,
                    duration_s=lc.duration_s)


def generate_message(client_id: str, out: StepOutput, lc: RequestLifecycle) -> pb.GenerateServerMessage:
    """A delta, or the final message when `out` ends the request (with n > 1: the last completion to end)."""
    fields = dict(text=out.text, token_ids=out.new_token_ids, index=out.index,
                  finish_reason=_FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                  logprobs=[token_logprobs(lp, token) for lp, token in zip(out.logprobs or (), out.new_token_ids)],
                  prompt_logprobs=[token_logprobs(lp) for lp in out.prompt_logprobs or ()])
    if not out.finished:
        return pb.GenerateServerMessage(request_id=client_id, delta=pb.TokenDelta(**fields))
    return pb.GenerateServerMessage(request_id=client_id, final=pb.GenerateFinal(**fields, usage=usage(lc)))


def token_logprobs(logprobs: Logprobs | None, chosen: int | None = None) -> pb.TokenLogprobs:
    """One position: the chosen token first (for a prompt position, the engine's first entry), then the others,
    most likely first. None (the first prompt token) is an empty entry."""
    if not logprobs:
        return pb.TokenLogprobs()
    if chosen is None:
        chosen = next(iter(logprobs))
    first = [chosen] if chosen in logprobs else []
    rest = sorted((t for t in logprobs if t != chosen), key=lambda t: -logprobs[t])
    return pb.TokenLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=logprobs[t]) for t in first + rest])


def request_error(error: ServiceError) -> pb.RequestError:
    return pb.RequestError(code=error.code.value[0], message=error.message)  # the google.rpc.Code number


def rerank_response(client_id: str, out: StepOutput, documents: list[str], params: RerankParams,
                    lc: RequestLifecycle) -> pb.RerankResponse:
    """Results sorted by score (ties by input index), cut to top_n, documents attached on request."""
    results = [pb.RerankResult(index=r.index, score=r.score, document=r.document, document_tokens=r.document_tokens,
                               truncated=r.truncated)
               for r in rank_scores(out.scores, documents, params.top_n, params.return_documents,
                                    out.document_tokens, out.truncated)]
    return pb.RerankResponse(request_id=client_id, results=results, usage=usage(lc))
