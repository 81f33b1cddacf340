"""sentence-transformers `encode` timed in its own process: run by bench/embed_speed.py with a peer venv's python
(`python bench/peers/st_worker.py JOB.json`), so it imports nothing of tandem. The job file names the model directory,
the texts, the backend (torch or onnx), threads and batch size; the worker prints one JSON line with its timings
and library versions and saves the vectors (float32, one row per text) to the job's `vectors` path (.npy).

ONNX: the model is exported once through optimum (sentence-transformers' own export, `backend="onnx"`) into the
job's `onnx_dir`, a copy of the model directory under ~/.cache/tandem, and loaded from there afterwards.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path


def _versions(names):
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def _load(job):
    from sentence_transformers import SentenceTransformer

    if job["backend"] == "torch":
        return SentenceTransformer(job["model_dir"], device="cpu", backend="torch")
    import onnxruntime as ort

    onnx_dir = Path(job["onnx_dir"])
    if not (onnx_dir / "onnx" / "model.onnx").is_file():
        shutil.rmtree(onnx_dir, ignore_errors=True)
        shutil.copytree(job["model_dir"], onnx_dir)
        exported = SentenceTransformer(str(onnx_dir), device="cpu", backend="onnx")  # exports through optimum
        exported.save(str(onnx_dir))
        del exported
    options = ort.SessionOptions()
    options.intra_op_num_threads = job["threads"]
    options.inter_op_num_threads = 1
    return SentenceTransformer(str(onnx_dir), device="cpu", backend="onnx",
                               model_kwargs={"provider": "CPUExecutionProvider", "session_options": options})


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    import numpy as np
    import torch

    torch.set_num_threads(job["threads"])
    texts = job["texts"]
    batch = job["batch_size"]
    t0 = time.perf_counter()
    model = _load(job)
    load_s = time.perf_counter() - t0
    model.encode(texts[:batch], batch_size=batch)  # warm: first-call costs stay out of the figures
    alone = []
    for _ in range(job["alone_repeats"]):
        start = time.perf_counter()
        model.encode(texts[:batch], batch_size=batch)
        alone.append(time.perf_counter() - start)
    load_before = os.getloadavg()
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch, convert_to_numpy=True)
    wall = time.perf_counter() - start
    np.save(job["vectors"], vectors.astype(np.float32))
    print(json.dumps({
        "texts_s": len(texts) / wall, "wall_s": wall, "texts": len(texts), "alone_batch_p50_s": statistics.median(alone),
        "alone_batch_s": alone, "load_s": load_s, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "torch_threads": torch.get_num_threads(), "max_seq_length": model.max_seq_length,
        "versions": _versions(["sentence-transformers", "torch", "transformers", "tokenizers", "optimum",
                               "optimum-onnx", "onnxruntime", "onnx", "numpy"]),
    }))


if __name__ == "__main__":
    main()
