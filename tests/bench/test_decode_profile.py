"""bench/decode_profile.py on the embedded SmolLM2 file: every op of a batch-1 decode step is timed where it runs,
the matmuls' weight bytes agree with the file's, and the engine is left as it was."""
from __future__ import annotations

import pytest

import kernels
from bench.bandwidth import decode_bytes_per_token
from bench.decode_profile import PROJECTIONS, profile, render
from engine.models.loader import embedded_gguf_path


@pytest.fixture(scope="module")
def result() -> dict:
    return profile(embedded_gguf_path(), context=8, steps=2, threads=2, service=False)


def test_every_op_of_the_step_is_timed(result) -> None:
    ops = result["ops_s"]
    assert set(PROJECTIONS) | {"lm_head", "attention", "norms", "rope", "act", "embed"} <= set(ops)
    assert all(v > 0 for v in ops.values())
    assert sum(ops.values()) <= result["loop_forward_s"] <= result["loop_step_s"]
    assert result["walker"] and result["forward_s"] <= result["step_s"]


def test_the_matmuls_read_the_files_weight_bytes(result) -> None:
    # the file's bytes per token (bench.bandwidth, from the GGUF's tensor table) less its small float32 norms
    from_file = decode_bytes_per_token(embedded_gguf_path())["bytes"]
    assert sum(result["weight_bytes"].values()) == pytest.approx(from_file, rel=0.01)


def test_the_table_has_a_row_per_op_and_the_engine_is_left_untouched(result) -> None:
    table = render(result, "135m")
    for label in ("q/k/v projection", "down projection", "LM head", "attention", "RMS norms", "all matmuls",
                  "engine outside the forward"):
        assert sum(label in line for line in table.splitlines()) == 1, label
    from kernels import paged

    assert kernels.write_and_attend is paged.write_and_attend  # the timing wrapper is gone
