"""Which model a request may name, per rerank mode, and which models /v1/models and gRPC ModelInfo list with which
kinds of work (service/core.py; docs/http.md "Which model a request may name"), on a CoreAPI built from a ModelInfo
alone: the checks need no engine. The same rules through both doors, on served models: tests/service/
test_rerank_modes.py (dense, cascade) and test_http_openai.py (fusion)."""
from __future__ import annotations

import pytest

from service.core import CoreAPI, Limits, ModelInfo, Names, ServedModel, Task
from service.errors import ErrorKind, ServiceError

LLM, EMBEDDER, CROSS = "SmolLM2-135M-Instruct", "all-MiniLM-L6-v2", "bge-reranker-v2-m3"
G, E, R = Task.GENERATE, Task.EMBED, Task.RERANK


def _core(mode: str, *, strict: bool = False, embedder: str = EMBEDDER) -> CoreAPI:
    info = ModelInfo(model=LLM, served_names=(LLM,), rerank_mode=mode, embedder=embedder, max_model_len=8192,
                     embedder_max_tokens=256, rerank_max_pair_tokens=512,
                     reranker=f"/models/{CROSS}" if mode == "cross-encoder" else "")
    return CoreAPI(None, Limits(), info, None, None, Names(strict=strict), aliases=(f"/models/{LLM}",))


@pytest.mark.parametrize("mode, listed", [
    ("dense", [(LLM, (G,), 8192), (EMBEDDER, (E, R), 256)]),
    ("fusion", [(LLM, (G, R), 8192), (EMBEDDER, (E, R), 256)]),
    ("cascade", [(LLM, (G, R), 8192), (EMBEDDER, (E, R), 256)]),
    ("likelihood", [(LLM, (G, R), 8192), (EMBEDDER, (E,), 256)]),
    ("judge", [(LLM, (G, R), 8192), (EMBEDDER, (E,), 256)]),
    ("cross-encoder", [(LLM, (G,), 8192), (EMBEDDER, (E,), 256), (CROSS, (R,), 512)]),
])
def test_each_served_model_is_listed_with_the_kinds_it_does(mode, listed):
    assert _core(mode).models() == [ServedModel(*m) for m in listed]


def test_without_an_embedder_the_llm_alone_is_listed():
    assert _core("likelihood", embedder="").models() == [ServedModel(LLM, (G, R), 8192)]


def _refusal(core: CoreAPI, model: str, task: Task) -> ServiceError | None:
    try:
        core._check_task(model, task)
        core._check_served(model, task)
    except ServiceError as exc:
        return exc
    return None


@pytest.mark.parametrize("mode", ["dense", "fusion", "cascade", "likelihood", "judge", "cross-encoder"])
def test_a_request_may_name_any_model_that_does_its_kind(mode):
    core = _core(mode)
    for m in core.models():
        for task in m.tasks:
            assert _refusal(core, m.name, task) is None, (m, task)
            assert _refusal(_core(mode, strict=True), m.name, task) is None, (m, task)


def test_a_model_that_does_not_do_the_kind_is_refused_naming_those_that_do():
    chat = _refusal(_core("dense"), EMBEDDER, G)
    assert chat.kind is ErrorKind.INVALID_ARGUMENT and f"send it to {LLM!r}" in chat.message
    embed = _refusal(_core("cross-encoder"), CROSS, E)
    assert embed.kind is ErrorKind.INVALID_ARGUMENT and f"send it to {EMBEDDER!r}" in embed.message
    rerank = _refusal(_core("cross-encoder"), EMBEDDER, R)
    assert rerank.kind is ErrorKind.INVALID_ARGUMENT and "does not rerank" in rerank.message
    assert f"send it to {CROSS!r}" in rerank.message
    both = _refusal(_core("likelihood", strict=True), EMBEDDER, R)
    assert both is not None and f"send it to {LLM!r}" in both.message


@pytest.mark.parametrize("mode, scorers", [("dense", [EMBEDDER]), ("cross-encoder", [CROSS])])
def test_a_rerank_naming_the_llm_where_it_does_not_score_is_served_unless_names_are_strict(mode, scorers):
    for name in (LLM, f"/models/{LLM}"):  # a served name, and the path as given
        assert _refusal(_core(mode), name, R) is None
        strict = _refusal(_core(mode, strict=True), name, R)
        assert strict.kind is ErrorKind.INVALID_ARGUMENT and "does not rerank" in strict.message
        assert all(repr(s) in strict.message for s in scorers)


def test_an_unknown_name_is_served_by_the_one_model_of_its_kind_unless_names_are_strict():
    for task in (R, E):
        assert _refusal(_core("dense"), "rerank-v3.5", task) is None
        strict = _refusal(_core("dense", strict=True), "rerank-v3.5", task)
        assert strict.kind is ErrorKind.NOT_FOUND and f"it serves [{EMBEDDER!r}]" in strict.message
    chat = _refusal(_core("dense"), "gpt-3.5-turbo", G)
    assert chat is None  # a chat's unknown name is check_model's 404, after these checks
    with pytest.raises(ServiceError) as caught:
        _core("dense").check_model("gpt-3.5-turbo")
    assert caught.value.kind is ErrorKind.NOT_FOUND


@pytest.mark.parametrize("mode, scorer", [("dense", EMBEDDER), ("fusion", f"{EMBEDDER}+{LLM}"),
                                          ("likelihood", LLM), ("cross-encoder", CROSS)])
def test_the_rerank_name_is_the_model_that_scores(mode, scorer):
    assert _core(mode).rerank_name == scorer
