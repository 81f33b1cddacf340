"""transformers' reference outputs, computed once and kept as golden files (issue #64).

The parity tests compare our engine with transformers running the same model file. Computing those references took
~260 s of every serial run (Gemma 3's ~210 s, SmolLM2's greedy continuations ~50 s), so they are stored:

* checked in, under tests/data/references/NAME.json (small: token ids and log-probabilities), each with the KEY it
  was computed under: the sha256 of the model file, the transformers version and the torch version;
* a fixture whose key does not match the checked-in file computes the reference anew (correct, just slower) and
  keeps it under ~/.cache/tandem/test-references/ (TANDEM_CACHE_DIR moves it), so the next session is fast again;
* tests/test_references.py fails while a checked-in file's key is stale, naming the command that regenerates them:

    python -m tests.references          # all of them (a few minutes on 2 cores)
    python -m tests.references gemma    # one of them

Nothing here loads transformers until a reference must actually be computed.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

CHECKED_IN = Path(__file__).parent / "data" / "references"
FORMAT = 1  # bump when a reference's content changes shape, so old files count as stale


def _cache_dir() -> Path:
    from engine.settings import Settings

    return Settings.from_env().cache_dir / "test-references"


_SHA_CACHE: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a model file, memoized per (path, size, mtime) within the process."""
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns)
    if memo not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _SHA_CACHE[memo] = h.hexdigest()
    return _SHA_CACHE[memo]


def key_for(model_file: Path) -> dict:
    """What a reference depends on: the model's bytes and the library versions that compute it."""
    import torch
    import transformers

    return {"format": FORMAT, "model_sha256": file_sha256(model_file), "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0]}


@dataclass(frozen=True)
class Spec:
    """One reference: the model file it is keyed by, and how to compute it (a JSON-able dict)."""
    name: str
    model_file: Callable[[], Path]
    compute: Callable[[], dict]


def _gemma_file() -> Path:
    from tests.gemma import gemma_gguf_path

    return gemma_gguf_path()


def _gemma_compute() -> dict:
    from tests.gemma import gemma_prompts, transformers_reference

    return asdict(transformers_reference(_gemma_file(), gemma_prompts()))


def _smollm2_file() -> Path:
    from engine.models.loader import embedded_gguf_path

    return embedded_gguf_path()  # the safetensors the reference loads is converted from it by transformers (keyed)


def _smollm2_compute() -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings
    from tests.engine.conftest import _prompts, hf_greedy_one_at_a_time

    model_dir = default_model_dir(Settings.from_env().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {"greedy_32": hf_greedy_one_at_a_time(model, tokenizer, _prompts(tokenizer), 32)}


def _smollm2_prefix_compute() -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.loader import default_model_dir
    from engine.settings import Settings
    from tests.engine.conftest import hf_greedy_one_at_a_time
    from tests.engine.test_hf_parity import SHARED_PREFIX_PROMPTS

    model_dir = default_model_dir(Settings.from_env().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {"greedy_16": hf_greedy_one_at_a_time(model, tokenizer, SHARED_PREFIX_PROMPTS, 16)}


SPECS = {s.name: s for s in (Spec("gemma", _gemma_file, _gemma_compute),
                             Spec("smollm2", _smollm2_file, _smollm2_compute),
                             Spec("smollm2_prefix", _smollm2_file, _smollm2_prefix_compute))}


def checked_in_path(name: str) -> Path:
    return CHECKED_IN / f"{name}.json"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, key: dict, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "data": data}, separators=(",", ":")) + "\n")
    tmp.replace(path)  # atomic: two xdist workers may write the same cache file


def stale(name: str) -> tuple[dict, dict | None]:
    """(the current key, the checked-in file's key or None when missing): stale when they differ."""
    spec = SPECS[name]
    stored = _read(checked_in_path(name))
    return key_for(spec.model_file()), (stored or {}).get("key")


def load(name: str) -> dict:
    """The reference `name` for the installed model and libraries: the checked-in file when its key matches, else
    the cache's, else computed now (and cached)."""
    spec = SPECS[name]
    key = key_for(spec.model_file())
    stored = _read(checked_in_path(name))
    if stored and stored.get("key") == key:
        return stored["data"]
    cached_path = _cache_dir() / f"{name}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    cached = _read(cached_path)
    if cached and cached.get("key") == key:
        return cached["data"]
    data = spec.compute()
    _write(cached_path, key, data)
    return data


def regenerate(names: list[str]) -> None:
    for name in names:
        spec = SPECS[name]
        key = key_for(spec.model_file())
        print(f"computing {name} (transformers {key['transformers']}, torch {key['torch']}) ...", flush=True)
        _write(checked_in_path(name), key, spec.compute())
        print(f"wrote {checked_in_path(name)}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    unknown = [n for n in sys.argv[1:] if n not in SPECS]
    if unknown:
        sys.exit(f"unknown reference(s) {unknown}; known: {sorted(SPECS)}")
    regenerate(sys.argv[1:] or sorted(SPECS))
