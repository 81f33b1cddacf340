import os

# Triton kernels run in the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engine threads and test threads share 2 cores: spinning OpenMP workers can slow a step 25x, so let them sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Encoders run float32 under --encoder-dtype auto on every host, so the parity tests hold sentence-transformers' and
# transformers' float32 bounds whatever the CPU; the bf16 path (auto's choice on CPUs with native bf16) is tested by
# name (tests/engine/test_encoder_dtype.py, tests/service/test_encoder_dtype_doors.py).
os.environ.setdefault("TANDEM_NATIVE_BF16", "0")

import pytest  # noqa: E402
import uvloop  # noqa: E402


# `make test` runs two pytest-xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0`,
# docs/testing.md). Each test file is one unit of work, so its module fixtures (an engine, a server) are built once.
# loadfile, not loadgroup with a mark per file: under pytest 9.2 xdist 3.8.0's loadgroup sets `item._nodeid`, which
# pytest 9 no longer reads, so groups were silently ignored and a file's tests (and module fixtures) were spread over
# both workers. The units known to be longest go first so neither worker is left with a long one at the end; the rest
# keep the collection order. --max-worker-restart=0: xdist 3.8.0's scope schedulers (loadfile's too) hang for ever
# when they replace a crashed worker (pytest-xdist issues #1323 and #1327, fixed after that release); without a
# restart a crash fails the run at once, naming the test.
_LONGEST_FIRST = [  # the files' own times in an idle run at df96c1b (junit), longest first
    "tests/cluster/test_cluster.py", "tests/engine/test_rerank_llm.py", "tests/models/test_gemma3_gguf.py",
    "tests/reliability/test_soak.py", "tests/engine/test_structured.py", "tests/engine/test_calibrate.py",
    "tests/bench/test_big_model.py", "tests/service/test_doc_snippets.py", "tests/engine/test_quantized.py",
    "tests/service/test_gemma_serve.py", "tests/bench/test_rerank_quality.py", "tests/engine/test_hf_parity.py",
    "tests/models/test_hub_models.py", "tests/service/test_http_schema_fuzz.py",
    "tests/reliability/test_fuzz_process.py", "tests/models/test_wide_walker.py", "tests/models/test_tiny_decoders.py",
    "tests/bench/test_rerank_serve.py", "tests/engine/test_embed_stages.py", "tests/engine/test_generation_api.py",
    "tests/service/test_operator.py", "tests/engine/test_cuda_graphs.py", "tests/service/test_cli_output.py"]


def _unit(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so their collections agree
        rank = {unit: i for i, unit in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item), len(rank)))  # stable: files keep their order otherwise


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker():
    """Under `make test`'s two xdist workers on two cores, each worker's torch runs one intra-op thread (set before
    every test: a test that builds an engine with `num_threads` changes the process's setting for good). Two threads a
    worker put four on two cores, and each parallel region waited at its barrier for a thread the other worker's had
    preempted (issue #64). `tandem serve` subprocesses keep their own default; a serial run (TEST_WORKERS=0) keeps
    torch's."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    yield


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
    """transformers' greedy continuations and prompt log-probabilities on the same file: the checked-in golden file
    when its key (the file's sha256, transformers' and torch's versions) matches, else computed once and cached
    (tests/references.py)."""
    from tests.gemma import Reference
    from tests.references import load

    return Reference(**load("gemma"))
