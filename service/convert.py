"""Protobuf messages to engine arguments and engine outputs to protobuf messages."""
from __future__ import annotations

from typing import Any

from engine import RerankParams, SamplingParams
from engine.outputs import StepOutput, rank_scores
from proto import tandem_pb2 as pb
from service.errors import ServiceError, invalid
from service.lifecycle import RequestLifecycle

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING if msg.HasField(name)}
    try:
        return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                              ignore_eos=msg.ignore_eos, priority=msg.priority, **kwargs)
    except ValueError as exc:
        raise invalid(str(exc)) from None


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
    if not out.finished:
        return pb.GenerateServerMessage(request_id=client_id,
                                        delta=pb.TokenDelta(text=out.text, token_ids=out.new_token_ids))
    final = pb.GenerateFinal(text=out.text, token_ids=out.new_token_ids, usage=usage(lc),
                             finish_reason=_FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED))
    return pb.GenerateServerMessage(request_id=client_id, final=final)


def request_error(error: ServiceError) -> pb.RequestError:
    return pb.RequestError(code=error.code.value[0], message=error.message)  # the google.rpc.Code number


def rerank_response(client_id: str, out: StepOutput, documents: list[str], params: RerankParams,
                    lc: RequestLifecycle) -> pb.RerankResponse:
    """Results sorted by score (ties by input index), cut to top_n, documents attached on request."""
    results = [pb.RerankResult(index=r.index, score=r.score, document=r.document)
               for r in rank_scores(out.scores, documents, params.top_n, params.return_documents)]
    return pb.RerankResponse(request_id=client_id, results=results, usage=usage(lc))
