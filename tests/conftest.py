import os

# Triton kernels run in the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engine threads and test threads share 2 cores: spinning OpenMP workers can slow a step 25x, so let them sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import uvloop  # noqa: E402


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, the loop the service uses."""
    return {"uvloop": uvloop.new_event_loop}
