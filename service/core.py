"""The core API: the one typed, async interface both doors call (the shape of vLLM's EngineClient, TEI's Infer).

Engine types in (`SamplingParams`, `RerankParams`, prompts, chat messages, token ids), engine types out
(`TokenDelta`, `RerankResult`) plus the small dataclasses of service/core_types.py; never protobuf, never JSON. What a request names
(the model, its task, chat roles) is checked here, so a request is refused the same way whichever door it came
through; what it carries (an empty input, the document and input counts of --max-documents and --max-embed-inputs,
no embedder loaded, a prompt too long, a bad schema) is the engine intake's to check, once (engine/intake.py), and
comes back as a `ServiceError` from the same place (the bridge turns the engine's ValueError into INVALID_ARGUMENT,
its NotLoaded into FAILED_PRECONDITION). Tokenizing never happens on the engine thread: the bridge's intake
thread tokenizes prompts, chats and rerank pairs (and cuts documents to `max_tokens_per_doc` there); `tokenize` runs
on a worker thread.

    core = await CoreAPI.load(bridge, limits)
    stream = core.generate([GenerateInput("a", params, prompt="Hi")], metadata)   # admitted, or ServiceError
    async for event in stream: ...                                                # GenerateEvent per output
    outcome = await core.rerank(RerankInput("r", query, documents, RerankParams()), metadata)

One request id: the core mints it (service/request_ids.py `new_request_id`, unique in the process) for every request it admits, and the
engine, its step records, the spans, the lifecycle hooks and the HTTP responses' ids (`chatcmpl-<id>`, a rerank's or
embedding's `id`) all use it (`GenerationStream.ids`, `RerankOutcome.id`, `EmbedOutcome.id`). A gRPC client's own
`request_id` stays what it was: that stream's key, echoed in that door's responses (the inputs' `request_id`; the
HTTP door sets none).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from engine.outputs import EmbedOutput, RerankOutput, rank_scores
from engine.request import FinishReason
from engine.specs import EmbedSpec, GenerateSpec, RerankSpec
from service import served_models
from service.core_types import (CHAT_ROLES, DEFAULT_MAX_BUFFER_BYTES, GRPC_CUT_HINT, EmbedInput, EmbedOutcome, Encoder,
                                GenerateEvent, GenerateInput, Limits, ModelInfo, Names, PooledOutcome, RerankInput,
                                RerankOutcome, ServedModel, Usage)
from service.errors import ErrorKind, ServiceError, invalid
from service.generation_stream import GenerationStream
from service.json_schema import json_schema
from service.kinds import KINDS, Task, pooled
from service.lifecycle import CLIENT_GONE, RequestLifecycle
from service.request_ids import new_request_id
from service.served_models import EMBEDDED_SUFFIX, short_name
from service.tokens import TokenTexts, build_token_texts
from service.tool_calls import ToolPlan, ToolSettings, ToolSupport
from service.tool_calls import plan as plan_tools
from service.tool_calls import support as tool_support

if TYPE_CHECKING:
    from service.bridge import EngineBridge


class CoreAPI:
    """generate / rerank / abort / tokenize / model_info over a started EngineBridge."""

    def __init__(self, bridge: "EngineBridge", limits: Limits, info: ModelInfo, token_texts: TokenTexts,
                 tokenizer: Any, names: Names = Names(), aliases: tuple[str, ...] = (),
                 tools: ToolSupport = ToolSupport()) -> None:
        self.tools = tools  # what the served model can do with a request's tools
        self.bridge = bridge
        self.limits = limits
        self.info = info
        self.token_texts = token_texts  # each token id's text and bytes (OpenAI logprobs)
        self._tokenizer = tokenizer  # read-only here, on worker threads
        self._strict = names.strict
        self._accepted = {"", *info.served_names, *aliases}

    @classmethod
    async def load(cls, bridge: "EngineBridge", limits: Limits, names: Names = Names(),
                   tools: ToolSettings | ToolSupport = ToolSettings()) -> "CoreAPI":
        """Ask the engine what it serves; build the token texts on a worker thread."""
        engine_info = await bridge.model_info()
        tokenizer = bridge.engine.tokenizer
        texts = await asyncio.to_thread(build_token_texts, tokenizer, engine_info["vocab_size"])
        given = str(engine_info["model"])  # the path as the operator gave it (or the embedded model's name)
        served = tuple(dict.fromkeys(names.served)) or (short_name(given),)
        known = {f.name for f in fields(ModelInfo)}
        config = bridge.engine.config  # the engine checks these counts (engine/intake.py); ModelInfo tells them
        info = ModelInfo(**{k: v for k, v in engine_info.items() if k in known and k not in ("model", "served_names")},
                         model=served[0], served_names=served, max_waiting=bridge.max_waiting,
                         max_documents=config.max_rerank_documents, max_embed_inputs=config.max_embed_inputs,
                         max_message_bytes=limits.max_message_bytes,
                         encoders={k.task: Encoder.of(engine_info, k.model_field) for k in pooled()})
        # Without --served-model-name the path as given still names the model (clients written against it keep
        # working); it is not listed.
        if isinstance(tools, ToolSettings):  # the flags: resolved against the served model (ValueError: they cannot be)
            tools = tool_support(tools, tokenizer.chat_template, bridge.engine.hf_config.get("model_type"), tokenizer)
        return cls(bridge, limits, info, texts, tokenizer, names, aliases=() if names.served else (given,),
                   tools=tools)

    # ---- checks that need no engine --------------------------------------------------------------

    @property
    def rerank_model(self) -> str:
        """The cross-encoder's id ("" in the other modes: the embedder, the LLM or both score reranks then)."""
        return served_models.rerank_model(self.info)

    @property
    def rerank_name(self) -> str:
        """The id of what scores reranks, as responses and the access log name it (served_models.rerank_name)."""
        return served_models.rerank_name(self.info)

    def models(self) -> list[ServedModel]:
        """Each model this replica serves with what it does (served_models.served_models)."""
        return served_models.served_models(self.info)

    def model_tasks(self) -> dict[str, tuple[Task, ...]]:
        """Each listed model's id and what it does, the served LLM's names first."""
        return {m.name: m.tasks for m in self.models()}

    def _check_task(self, model: str, task: Task) -> None:
        """A request naming a model this replica serves for something else is refused (served_models.check_task)."""
        served_models.check_task(self.info, self._accepted, self._strict, model, task)

    def _check_served(self, model: str, task: Task) -> None:
        """A request naming no model of this replica, under strict names (served_models.check_served)."""
        served_models.check_served(self.info, self._accepted, self._strict, model, task)

    def check_model(self, model: str) -> None:
        if model not in self._accepted:
            raise ServiceError(ErrorKind.NOT_FOUND,
                               f"model {model!r} is not served by this replica; it serves "
                               f"{list(self.info.served_names)} (leave model empty for the default)")

    def model_name(self, model: str) -> str:
        """The name a response echoes: the one the client gave, else the served model's."""
        return model or self.info.model

    # ---- generation ------------------------------------------------------------------------------

    def refused(self, kind: Task, request_id: str, metadata: dict[str, str], error: ServiceError) -> None:
        """A request of kind `kind` refused before the engine admitted it (by these checks, or by a door's own): the
        lifecycle hooks hear of it under the kind's label (the access log writes its line)."""
        self.bridge.refused(request_id, KINDS[kind].label, metadata, error.kind.name, error.message)

    def refused_at_door(self, kind: str, metadata: dict[str, str], status: str) -> None:
        """A request a door refused on its own terms (an HTTP body that does not parse, a wrong Content-Type, a
        missing token), with the status the door answered."""
        self.bridge.refused("", kind, {**metadata, "status": status}, None)

    @staticmethod
    def _named(metadata: dict[str, str], model: str, default: str) -> dict[str, str]:
        """The request's metadata with the model it named (else the one its kind is served by), for the access log of
        a request refused before it ran: a refused name is logged as given."""
        return {**metadata, "model": model or default}

    @staticmethod
    def _worked(metadata: dict[str, str], model: str, worker: str) -> dict[str, str]:
        """The metadata of an admitted request, for the access log and its span: `model` the model that does the
        work (the scorer of a rerank, the embedder, the LLM's served name), `requested_model` what the request
        named where that was another name."""
        out = {**metadata, "model": worker}
        if model and model != worker:
            out["requested_model"] = model
        return out

    @contextlib.contextmanager
    def _admitting(self, kind: Task, request_id: str, metadata: dict[str, str]) -> Iterator[None]:
        try:
            yield
        except ServiceError as exc:
            self.refused(kind, request_id, metadata, exc)
            raise

    def generate(self, inputs: Sequence[GenerateInput], metadata: dict[str, str], *,
                 relayed: bool = False) -> GenerationStream:
        """Admit every input (all or none: a refusal aborts those admitted before it and raises ServiceError);
        their outputs arrive through the returned stream, bounded by --max-stream-buffer-bytes. `relayed`: the
        caller moves each event at once into a bounded channel of its own (the gRPC door's stream session), which
        is then the one bound, so the returned stream counts nothing (GenerationStream)."""
        stream = GenerationStream(self.bridge, None if relayed else self.limits.max_stream_buffer_bytes)
        named = inputs[0].model if inputs else ""
        # An accepted name is one of the LLM's (an alias, the path as given): its served name did the work.
        metadata = self._worked(metadata, named, self.info.model) if named in self._accepted else \
            self._named(metadata, named, self.info.model)
        try:
            for index, inp in enumerate(inputs):
                self._check_generate(inp)
                spec = GenerateSpec(new_request_id(KINDS[Task.GENERATE]), inp.prompt, inp.params, messages=inp.messages,
                                    tools=inp.tools)
                lc = self.bridge.submit(spec, inp.request_id, stream.sink(index, inp.request_id),
                                        timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
                stream._admitted(inp.request_id, lc)
        except ServiceError as exc:
            stream.abort()
            self.refused(Task.GENERATE, inputs[0].request_id if inputs else "", metadata, exc)
            raise
        return stream

    def _check_generate(self, inp: GenerateInput) -> None:
        """What the request names; its input (none, both, empty) is the engine intake's to check."""
        self._check_task(inp.model, Task.GENERATE)
        self.check_model(inp.model)
        _check_roles(inp.messages)

    def tool_plan(self, tools: list[dict] | None, tool_choice: str | dict | None,
                  parallel: bool | None = None) -> ToolPlan | None:
        """What a request's tools and tool_choice ask for (service/tool_calls.py), with the served model's tool format
        and template; INVALID_ARGUMENT naming what is wrong (a template that renders no tools names the shipped ones
        that do). A door puts the plan's template_tools in GenerateInput.tools and its structured_outputs in the
        params, and reads the output back with plan.reader()."""
        try:
            return plan_tools(tools, tool_choice, parallel, self.tools)
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def abort(self, engine_id: str) -> None:
        self.bridge.abort(engine_id)

    # ---- rerank ----------------------------------------------------------------------------------

    async def rerank(self, inp: RerankInput, metadata: dict[str, str]) -> RerankOutcome:
        """Score inp's documents; raises ServiceError. Cancelling the await aborts the engine job."""
        scorer = self.rerank_name
        with self._admitting(Task.RERANK, inp.request_id, self._named(metadata, inp.model, scorer)):
            self._check_task(inp.model, Task.RERANK)
            self._check_served(inp.model, Task.RERANK)
            if inp.max_tokens_per_doc is not None and inp.max_tokens_per_doc < 1:
                raise invalid(f"max_tokens_per_doc must be >= 1, got {inp.max_tokens_per_doc}")
        metadata = self._worked(metadata, inp.model, scorer)
        params = inp.params
        if inp.max_tokens_per_doc is not None:  # cut where the engine tokenizes the documents anyway (once)
            params = replace(params, max_document_tokens=inp.max_tokens_per_doc)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._admitting(Task.RERANK, inp.request_id, metadata):
            lc = self.bridge.submit(RerankSpec(new_request_id(KINDS[Task.RERANK]), inp.query, inp.documents, params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
        event: RerankOutput = await self._final(future, lc, KINDS[Task.RERANK].verb, inp.cut_hint)
        results = rank_scores(event.scores, inp.documents, inp.top_n, inp.return_documents,
                              event.document_tokens, event.truncated, event.windows)
        return RerankOutcome(inp.request_id, results, Usage.of(lc), self.info.rerank_mode, id=lc.engine_id,
                             model=scorer)

    async def _final(self, future: asyncio.Future, lc: RequestLifecycle, what: str, cut_hint: str
                     ) -> RerankOutput | EmbedOutput:
        """The one final output of an admitted rerank or embed job; cancelling the await (the client left, its
        deadline passed) aborts the job. Raises its ServiceError (an input too long says how to ask, in the
        request's own API, for the cut: `cut_hint`), or UNAVAILABLE if the server aborted it."""
        try:
            event = await future
        except asyncio.CancelledError:  # its client left (a door cancels the call when it hears of that)
            lc.metadata[CLIENT_GONE] = "1"
            raise
        finally:
            if not future.done() or future.cancelled():
                self.bridge.abort(lc.engine_id)
        if isinstance(event, ServiceError):
            if event.too_long:
                raise ServiceError(event.kind, f"{event.message} or {cut_hint}") from None
            raise event
        if event.finish_reason is FinishReason.ABORT:  # aborted by the server (drain timeout)
            raise ServiceError(ErrorKind.UNAVAILABLE, f"{what} aborted: the server is shutting down; retry")
        return event

    # ---- embeddings ------------------------------------------------------------------------------

    async def embed(self, inp: EmbedInput, metadata: dict[str, str]) -> EmbedOutcome:
        """One vector per input; raises ServiceError. Cancelling the await aborts the engine job. A request naming
        another model is embedded by the one embedder anyway (as a rerank is scored), unless names are strict."""
        embedder = self.info.embedder
        with self._admitting(Task.EMBED, inp.request_id, self._named(metadata, inp.model, embedder)):
            self._check_task(inp.model, Task.EMBED)
            self._check_served(inp.model, Task.EMBED)
        metadata = self._worked(metadata, inp.model, embedder)
        with self._admitting(Task.EMBED, inp.request_id, metadata):
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            lc = self.bridge.submit(EmbedSpec(new_request_id(KINDS[Task.EMBED]), inp.inputs, inp.params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata, owner=owner(metadata))
        event: EmbedOutput = await self._final(future, lc, KINDS[Task.EMBED].verb, inp.cut_hint)
        return EmbedOutcome(inp.request_id, event.embeddings, event.truncated, Usage.of(lc), self.info.embedder,
                            id=lc.engine_id)

    # ---- kinds served by an encoder of their own (classification, sparse embeddings) ------------------------

    async def pool(self, task: Task, inp: EmbedInput, metadata: dict[str, str]) -> PooledOutcome:
        """An embedding job whose rows run on kind `task`'s own encoder (service/kinds.py pooled(): --classifier's
        label probabilities, --sparse-embedder's sparse vectors): per input, what its row became; raises
        ServiceError (INVALID_ARGUMENT naming the flag where no such encoder is loaded). Cancelling the await aborts
        the engine job."""
        kind = KINDS[task]
        encoder = self.info.encoder(task)
        model = encoder.name
        with self._admitting(task, inp.request_id, self._named(metadata, inp.model, model)):
            if not model:
                raise invalid(f"this server has no {kind.model_field.replace('_', ' ')}: start it with {kind.flag} "
                              f"DIR|HUB_ID to serve {kind.verb}")
            self._check_task(inp.model, task)
            self._check_served(inp.model, task)
        metadata = self._worked(metadata, inp.model, model)
        params = replace(inp.params, task=kind.pooling)
        with self._admitting(task, inp.request_id, metadata):
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            lc = self.bridge.submit(EmbedSpec(new_request_id(kind), inp.inputs, params),
                                    inp.request_id, lambda event: future.done() or future.set_result(event),
                                    timeout_ms=inp.timeout_ms, metadata=metadata)
        event: EmbedOutput = await self._final(future, lc, kind.verb, inp.cut_hint)
        return PooledOutcome(inp.request_id, event.embeddings, encoder.labels, event.truncated, Usage.of(lc), model,
                             id=lc.engine_id)

    # ---- tokens ----------------------------------------------------------------------------------

    async def tokenize(self, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None,
                       add_special_tokens: bool = True, model: str = "") -> list[int]:
        """A prompt's token ids (as a generation would have them), or a chat's as the chat template renders it for
        a reply; on a worker thread. Raises ServiceError."""
        self.check_model(model)
        _check_roles(messages)
        try:
            if prompt is not None and not add_special_tokens:
                if not prompt:
                    raise ValueError("prompt must not be empty")
                return await asyncio.to_thread(_plain_ids, self._tokenizer, prompt)
            return await self.bridge.prompt_token_ids(prompt, messages)
        except ValueError as exc:
            raise invalid(str(exc)) from None

    async def detokenize(self, token_ids: list[int], *, model: str = "") -> str:
        self.check_model(model)
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise invalid(f"tokens must be token ids in [0, {vocab})")
        return await asyncio.to_thread(self._tokenizer.decode, token_ids)

    async def stats(self) -> dict:
        return await self.bridge.stats()

    # ---- draining --------------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new work from now on (UNAVAILABLE through either door); in-flight work goes on."""
        self.bridge.draining = True

    @property
    def num_live(self) -> int:
        return self.bridge.num_live

    async def wait_idle(self) -> None:
        await self.bridge.wait_idle()

    def abort_all(self) -> None:
        self.bridge.abort_all()


def owner(metadata: dict[str, str]) -> str:
    """The client a request counts against for its share of --max-waiting (EngineBridge.fair_share), as its door
    names it: the gRPC stream it came on, else its peer (a gRPC connection's unary calls, an HTTP connection)."""
    return metadata.get("stream") or metadata.get("peer", "")


def _check_roles(messages: list[dict[str, str]] | None) -> None:
    """A chat's roles, the same for a generation and for /tokenize."""
    for i, m in enumerate(messages or ()):
        if not m.get("role"):
            raise invalid(f"messages[{i}].role must not be empty (e.g. 'system', 'user', 'assistant')")
        if m["role"] not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m['role']!r}")


def _plain_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# What the doors import from here: the API and the types it takes and returns (each defined in its own module).
__all__ = ["CHAT_ROLES", "CoreAPI", "DEFAULT_MAX_BUFFER_BYTES", "EMBEDDED_SUFFIX", "EmbedInput", "EmbedOutcome",
           "Encoder", "GRPC_CUT_HINT", "GenerateEvent", "GenerateInput", "GenerationStream", "Limits", "ModelInfo",
           "Names", "PooledOutcome", "RerankInput", "RerankOutcome", "ServedModel", "Task", "Usage", "json_schema",
           "new_request_id", "owner", "short_name"]
