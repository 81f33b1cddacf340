"""The GPU suite (issue #8): the Triton kernels compiled for a real CUDA device, and the engine on CUDA.

    make test-gpu            # this suite, then python -m bench.kernel_speed
    python -m pytest -q tests/gpu

`make test` never collects it (pyproject.toml: addopts --ignore=tests/gpu; a path named on the command line is
still collected). Without a CUDA device it stops before collecting anything, with exit code 4 and one message:
it never skips.
"""
from __future__ import annotations

import os

# The root conftest sets TRITON_INTERPRET=1 for the CPU suite. Triton reads it when a @triton.jit function is
# defined, so it must go before any kernel module is imported: here the kernels compile for the GPU.
os.environ.pop("TRITON_INTERPRET", None)
# The engine must pick Triton on CUDA tensors (dispatch's "auto"), whatever the caller's shell says.
os.environ.pop("TANDEM_KERNELS", None)

import pytest  # noqa: E402
import torch  # noqa: E402

NO_CUDA_EXIT = 4  # pytest's "usage error": the suite was started on a machine it cannot run on


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        pytest.exit(
            "tests/gpu needs a CUDA device and none is visible (torch.cuda.is_available() is False): run it on "
            "a GPU machine with `make test-gpu`; `make test` is the CPU suite.",
            returncode=NO_CUDA_EXIT,
        )
    from triton.runtime.jit import JITFunction

    from kernels import triton_kv_cache, triton_paged_attention, triton_varlen_attention

    kernels = (triton_kv_cache._write_kv_cache_kernel, triton_paged_attention._paged_attention_kernel,
               triton_varlen_attention._varlen_attention_kernel)
    if not all(isinstance(k, JITFunction) for k in kernels):
        pytest.exit(
            "the Triton kernels were defined under TRITON_INTERPRET=1 (a kernel module was imported before "
            "tests/gpu/conftest.py unset it): run tests/gpu in a pytest process of its own.",
            returncode=NO_CUDA_EXIT,
        )


@pytest.fixture(scope="session")
def cpu_llm():
    """The reference engine: embedded model on CPU, float32, same scheduling options as the CUDA engines."""
    from engine import LLM, EngineConfig
    from tests.gpu.engines import ENGINE_OPTIONS

    return LLM(EngineConfig(**ENGINE_OPTIONS))


@pytest.fixture(scope="session")
def prompts(cpu_llm) -> list[str]:
    from tests.gpu.engines import build_prompts

    return build_prompts(cpu_llm.tokenizer)


@pytest.fixture(scope="session")
def cpu_greedy(cpu_llm, prompts) -> list[list[int]]:
    """Greedy token ids of every prompt from the CPU float32 engine."""
    from tests.gpu.engines import GREEDY

    return [o.token_ids for o in cpu_llm.generate(prompts, GREEDY)]
