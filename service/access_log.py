"""One access-log line per finished request, from both doors: a lifecycle observer, so no door logs anything itself.

    grpc Generate model=M status=OK finish=stop prompt_tokens=12 completion_tokens=8 cached_tokens=0 ttft=0.031s
        latency=0.210s peer=ipv4:127.0.0.1:50312
    http /v2/rerank model=M status=200 finish=stop prompt_tokens=92 documents=2 cached_tokens=32 latency=0.450s
        peer=127.0.0.1:33738

The route is the HTTP path the door names in the request's metadata ("route"), or for gRPC the method its kind and
stream say (Classify and EmbedSparse run as embedding jobs: the gRPC door names them, metadata "method"). The status
is what the door answered: gRPC's code name, HTTP's status for it; a request aborted because its client went away
(a disconnect, a cancelled call) is `status=499 finish=abort` (nginx's "client closed request"), `CANCELLED` over
gRPC. A request refused before the engine admitted it (an unknown model, a full queue, draining; on HTTP also a body that does not parse, a wrong
Content-Type, a missing token) gets its line too, `finish=rejected`, from `on_refused`; one the engine's intake
refuses (an empty input, too many documents, a prompt too long) ends `finish=error` with the same status.
An error or a refusal says why, short (` reason="max_tokens is too large: ..."`, cut at REASON_CHARS). `model=` is
the model that did the work (the LLM's served name for a chat, the embedder for an embedding, the classifier or the
sparse embedder for theirs, for a rerank what
scored it: CoreAPI.rerank_name, e.g. the embedder in the dense mode), followed by `requested=NAME` where the request
named it otherwise (an alias, another model's name); a refused request's model is logged as given.
`tandem serve --no-access-log` leaves this observer out.
"""
from __future__ import annotations

import json
import logging


from service.errors import ErrorKind, ServiceError
from service import kinds
from service.lifecycle import CLIENT_GONE, Hooks, RequestLifecycle

log = logging.getLogger("tandem.access")



def route(lc: RequestLifecycle) -> str:
    """The HTTP path, or the gRPC method (RerankStream for a rerank that came on a stream)."""
    if "route" in lc.metadata:
        return lc.metadata["route"]
    if "method" in lc.metadata:  # an RPC its kind's label does not name: Classify, EmbedSparse (label "embed")
        return lc.metadata["method"]
    kind = kinds.by_label(lc.kind)
    if kind is None:
        return lc.kind
    if kind.stream_method and lc.metadata.get("stream", "").startswith(f"{kind.label}-"):
        return kind.stream_method
    return kind.grpc_method


def status(lc: RequestLifecycle) -> str:
    """gRPC: "OK" or the code name; HTTP: 200 or the status the door maps the code to (service/http/errors.py), or
    the one the door answered on its own (metadata "status")."""
    if "status" in lc.metadata:
        return lc.metadata["status"]
    gone = lc.metadata.get(CLIENT_GONE) and lc.error is None  # aborted because the client left: nginx's 499
    if lc.metadata.get("door") != "http":
        return "CANCELLED" if gone else lc.error or "OK"
    if gone:
        return "499"
    if lc.error is None:
        return "200"
    from service.http.errors import HttpError  # starlette only where the HTTP door runs

    return str(HttpError.from_service(ServiceError(ErrorKind.named(lc.error), "")).status)


class AccessLog(Hooks):
    def __init__(self, model_name: str, logger: logging.Logger = log) -> None:
        self.model_name = model_name
        self.log = logger

    def on_finish(self, lc: RequestLifecycle) -> None:
        kind = kinds.by_label(lc.kind)
        if kind is not None and kind.scores_pairs:
            counts = f"prompt_tokens={lc.prompt_tokens} documents={lc.documents} cached_tokens={lc.cached_tokens}"
        else:
            counts = (f"prompt_tokens={lc.prompt_tokens} completion_tokens={lc.completion_tokens} "
                      f"cached_tokens={lc.cached_tokens} ttft={lc.ttft_s:.3f}s")
        self.log.info("%s %s model=%s status=%s finish=%s%s %s latency=%.3fs peer=%s", lc.metadata.get("door", "-"),
                      route(lc), self._model(lc), status(lc), lc.finish_reason, _reason(lc), counts, lc.duration_s,
                      lc.metadata.get("peer") or "-")

    def on_refused(self, lc: RequestLifecycle) -> None:
        self.log.info("%s %s model=%s status=%s finish=rejected%s peer=%s", lc.metadata.get("door", "-"), route(lc),
                      self._model(lc), status(lc), _reason(lc), lc.metadata.get("peer") or "-")

    def _model(self, lc: RequestLifecycle) -> str:
        """The model that did the work (the core API puts it in the metadata), with ` requested=NAME` where the
        request named another; the served LLM's name for a request refused before the core read it (an HTTP body
        that does not parse)."""
        requested = lc.metadata.get("requested_model")
        return (lc.metadata.get("model") or self.model_name) + (f" requested={requested}" if requested else "")


REASON_CHARS = 120  # an error's message is cut here in the log (the client got all of it)


def _reason(lc: RequestLifecycle) -> str:
    """` reason="..."`: what an error or a refusal told the client, on one line and short; "" without one."""
    message = " ".join((lc.error_message or "").split())
    if not message:
        return ""
    if len(message) > REASON_CHARS:
        message = message[:REASON_CHARS - 3] + "..."
    return " reason=" + json.dumps(message)
