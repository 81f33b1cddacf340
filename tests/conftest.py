import os

# Triton kernels run in the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engine threads and test threads share 2 cores: spinning OpenMP workers can slow a step 25x, so let them sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import uvloop  # noqa: E402


# `make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder`): each test file is one
# unit of work, so its module fixtures (an engine, a server) are built once, and files that share an expensive session
# fixture are one unit, so it is computed once. Measured on a 2-core host (serial run, 2026-12-01): the Gemma 3 pair of
# files needs transformers' reference on the real GGUF file (~210 s to compute) and ~460 s in all; the SmolLM2 trio
# shares transformers' greedy outputs (hf_greedy, ~50 s). The longest units go first so neither worker is left with a
# long one at the end; the rest keep the collection order.
_SHARED_UNITS = {
    "tests/models/test_gemma3_gguf.py": "gemma-reference", "tests/service/test_gemma_serve.py": "gemma-reference",
    "tests/engine/test_hf_parity.py": "smollm2-reference", "tests/engine/test_cuda_graphs.py": "smollm2-reference",
    "tests/engine/test_quantized.py": "smollm2-reference",
}
_LONGEST_FIRST = ["gemma-reference", "tests/cluster/test_cluster.py", "smollm2-reference",
                  "tests/engine/test_rerank_llm.py", "tests/reliability/test_soak.py"]


def _unit(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    return _SHARED_UNITS.get(path, path)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so their collections agree
        rank = {unit: i for i, unit in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item), len(rank)))  # stable: files keep their order otherwise


@pytest.hookimpl(optionalhook=True)  # pytest-asyncio's hook: a pytest without it (a GPU image's) still starts
def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop the service uses."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def fake_tandem_server():
    """Serves a given Tandem servicer (a scripted fake) on a loopback port; returns its target. Stopped after."""
    from concurrent import futures

    import grpc

    from proto import tandem_pb2_grpc

    servers = []

    def serve(servicer) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        tandem_pb2_grpc.add_TandemServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        server.stop(None)


@pytest.fixture(scope="session")
def gemma_gguf():
    """The real Gemma 3 270M Q4_K_M GGUF file, assembled from its PyPI package (tests/gemma.py)."""
    from tests.gemma import gemma_gguf_path

    return gemma_gguf_path()


@pytest.fixture(scope="session")
def gemma_prompts() -> list[str]:
    from tests.gemma import gemma_prompts as prompts

    return prompts()


@pytest.fixture(scope="session")
def gemma_reference(gemma_gguf, gemma_prompts):
    """transformers' greedy continuations and prompt log-probabilities on the same file, once per session."""
    from tests.gemma import transformers_reference

    return transformers_reference(gemma_gguf, gemma_prompts)
