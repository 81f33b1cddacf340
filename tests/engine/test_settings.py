"""engine/settings.py: every TANDEM_* variable engine/ and kernels/ honour, read once into a frozen Settings."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.settings import Settings


def test_unset_or_empty_variables_give_the_defaults() -> None:
    for environ in ({}, {"TANDEM_KERNELS": "", "TANDEM_CPU_ISA": " ", "TANDEM_QUANT_SMALL_M": "",
                         "TANDEM_CACHE_DIR": ""}):
        s = Settings.from_env(environ)
        assert s == Settings()
        assert (s.kernels, s.cpu_isa, s.quant_small_m, s.fused_ops, s.layer_walker) == ("auto", "auto", None, True,
                                                                                        True)
        assert s.cache_dir == Path.home() / ".cache" / "tandem"


def test_each_variable_sets_its_field(tmp_path) -> None:
    s = Settings.from_env({"TANDEM_KERNELS": "Torch", "TANDEM_CPU_ISA": "PORTABLE", "TANDEM_QUANT_SMALL_M": "7",
                           "TANDEM_FUSED_OPS": "0", "TANDEM_LAYER_WALKER": "0", "TANDEM_CACHE_DIR": str(tmp_path)})
    assert s == Settings(kernels="torch", cpu_isa="portable", quant_small_m=7, fused_ops=False, layer_walker=False,
                         cache_dir=tmp_path)
    assert Settings.from_env({"TANDEM_FUSED_OPS": "1", "TANDEM_LAYER_WALKER": "yes"}).fused_ops is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kernels = "auto"  # type: ignore[misc]


@pytest.mark.parametrize("name, value, message", [
    ("TANDEM_KERNELS", "cuda", "TANDEM_KERNELS='cuda': expected one of torch, triton, cpp, auto"),
    ("TANDEM_CPU_ISA", "sse9", "TANDEM_CPU_ISA='sse9': expected auto or one of"),
    ("TANDEM_QUANT_SMALL_M", "-1", "TANDEM_QUANT_SMALL_M=-1"),
    ("TANDEM_QUANT_SMALL_M", "many", "TANDEM_QUANT_SMALL_M='many': expected a row count"),
])
def test_a_bad_value_is_refused_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_env({name: value})


def test_the_variables_reach_the_model_when_the_engine_is_built(monkeypatch, tmp_path) -> None:
    """Read at build, not per step: the model holds what the variables said then, and a later change does nothing."""
    from engine import SamplingParams
    from engine.models.decoder_ops import FusedOps
    from engine.models.loader import default_model_dir
    from kernels import quant
    from tests.engine.conftest import make_llm

    cache = default_model_dir(Settings.from_env().cache_dir).parent  # the converted embedded model, reused
    for name, value in {"TANDEM_KERNELS": "torch", "TANDEM_FUSED_OPS": "0", "TANDEM_QUANT_SMALL_M": "3",
                        "TANDEM_CACHE_DIR": str(cache)}.items():
        monkeypatch.setenv(name, value)
    # Fresh (not shared): built under the variables above. The embedded GGUF blocks: the quantized matmuls take the CPU
    # path's settings.
    llm = make_llm(num_kv_blocks=32, fresh=True)
    model = llm.engine.model
    assert model.kernels == "torch" and not isinstance(model.ops, FusedOps) and model.walker is None
    assert model.cpu_path.small_m == 3 and llm.engine.narrow_rows == 3  # the model's path, not the process's
    assert quant.default_cpu_path().small_m is None
    monkeypatch.setenv("TANDEM_KERNELS", "nonsense")  # read once: a step after the build never looks again
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 2
