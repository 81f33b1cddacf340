"""What a user who points tandem at the wrong thing is told: one clear exception naming the path, the unsupported
architecture, or the tensor whose type has no kernel (the CLI prints it as one line)."""
from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, EngineConfig


def _tiny_gguf(path, arch: str = "llama", tensor_type: str = "F32") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:  # raw blocks: 16 rows of one 256-wide super-block
        block = gguf.GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor("blk.0.ffn_down.weight", np.zeros((16, block), dtype=np.uint8), raw_shape=(16, block),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_missing_path_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(EngineConfig(model=str(tmp_path / "nope.gguf")))


def test_a_folder_without_config_or_gguf(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither a Hugging Face model directory \(no config.json\) nor a "
                                                r"folder with one .gguf file \(0 found\)"):
        LLM(EngineConfig(model=str(tmp_path)))


def test_a_file_that_is_not_gguf(tmp_path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LLM(EngineConfig(model=str(path)))


def test_an_unsupported_tensor_type_is_named_at_start_up(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "q2k.gguf"
    _tiny_gguf(path, tensor_type="Q2_K")
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down.weight' is stored as Q2_K, which tandem cannot "
                                         r"serve"):
        LLM(EngineConfig(model=str(path)))
    folder = tmp_path / "q2k.gguf"  # and through the folder that holds it: the same message
    with pytest.raises(ValueError, match="stored as Q2_K"):
        LLM(EngineConfig(model=str(folder.parent)))


def test_an_unsupported_architecture_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "phi.gguf"
    _tiny_gguf(path, arch="phi3")
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported; supported: llama"):
        LLM(EngineConfig(model=str(path)))
