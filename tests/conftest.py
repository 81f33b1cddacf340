import os

# Triton kernels run in the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import uvloop  # noqa: E402


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop the service uses."""
    return {"uvloop": uvloop.new_event_loop}
