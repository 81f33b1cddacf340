"""Start-up calibration: the step-time model knows this machine before the first request.

The latency objective plans every step with a step-time model (engine/step_time.py). Fitted online from slow priors
only, it is wrong exactly when a new kind of work arrives (an embedding forward priced at 10 ms where it costs ~1 ms,
the quantized matmul's narrow-to-wide jump unseen). `calibrate` runs a short sweep of real steps through the engine
itself before it serves (decode rows 1 / 4 / 8 / 20, a prompt chunk alone, and decodes beside prompt chunks, rerank
pairs and embedding rows as this engine has them), so the model fits what this model, host, thread count and CPU
path cost; the fit is cached per (model, scorer, embedder, host CPU, threads, ISA path, torch) in the cache directory
and a later start seeds the model from it in no time. Either way the model keeps refining online.

The sweep's requests are ordinary engine requests (ids `calibrate/...`) that finish before the engine serves
anything; its prompts leave only evictable prefix-cache blocks behind.

A fit taken on a busy host prices every step too high for good (a first start under load once priced 8 decodes at
1,061 ms where they take 67 ms), so the cache records the host's load with the fit, and:

* a cached fit taken under load (`LOADED`: the 1-minute load average per core) is measured again when the host is
  now at most half as busy;
* a cached fit is checked against the engine's first `CHECK_STEPS` real steps (`FitCheck`): when its median
  relative error on them is over `CHECK_MARGIN`, the online fit those steps refined replaces it in the cache;
* `TANDEM_RECALIBRATE=1` measures again whatever the cache holds (the start-up line says so).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.config import EmbedParams, RerankParams, SamplingParams
from engine.step_time import OnlineStepTime, StepShape

if TYPE_CHECKING:
    from engine.engine import LLMEngine

log = logging.getLogger("tandem.engine")

LOADED = 0.5  # a fit taken with more than this load per core (1-minute average) was taken on a busy host
CHECK_STEPS = 32  # real steps a cached fit is checked against
CHECK_MARGIN = 0.5  # ... and replaced when its median relative error on them is over this
RECALIBRATE_ENV = "TANDEM_RECALIBRATE"


def host_load() -> float:
    """The host's 1-minute load average per core (0.0 where the OS does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0

VERSION = 5  # bump when the sweep, the features or the forward's Python code change: older cached fits are ignored


@dataclass(frozen=True, slots=True)
class Calibration:
    """What calibration did: the fitted coefficients (seconds per feature unit), from the cache or measured."""
    coefficients: dict[str, float]
    spread: float  # the fit's robust spread of relative errors (what the planning margin comes from)
    steps: int  # steps the sweep ran (0: from the cache)
    seconds: float  # how long it took
    cached: bool
    path: Path
    load: float = 0.0  # the host's load per core when the fit was measured

    def summary(self) -> str:
        c = self.coefficients
        decode8 = OnlineStepTime.predict_with(c, StepShape(decode_rows=8, decode_context_tokens=8 * 256))
        how = f"from {self.path}" if self.cached else f"measured in {self.seconds:.1f} s over {self.steps} steps"
        return (f"step-time model ({how}): 8 decodes at 256 tokens {decode8 * 1e3:.1f} ms, forward "
                f"{c['llm_forward'] * 1e3:.2f} ms + {c['decode_rows'] * 1e3:.2f} ms a decode row; a prompt token "
                f"{c['prefill_tokens'] * 1e3:.3f} ms, an LLM pair token {c['llm_rerank_tokens'] * 1e3:.3f} ms, "
                f"wide-path jump {c['wide_forward'] * 1e3:.1f} ms; embedder forward {c['embed_forward'] * 1e3:.2f} "
                f"ms + {c['embed_tokens'] * 1e3:.3f} ms a token; cross-encoder forward "
                f"{c['cross_encoder_forward'] * 1e3:.2f} ms + {c['cross_encoder_tokens'] * 1e3:.3f} ms a token; "
                f"measured at load {self.load:.2f} a core ({RECALIBRATE_ENV}=1 measures it again)")


def cache_key(engine: "LLMEngine") -> str:
    """What a fit depends on: the models, their formats and paths, this CPU, the threads and the ISA path, and the
    C++ kernels' sources (their module name hashes them), so a fit priced by older kernels is measured again."""
    from kernels import quant

    cfg = engine.config
    parts = [VERSION, str(cfg.model), str(engine.model_dir), engine.quantization, engine.weight_format, cfg.dtype,
             cfg.device, str(cfg.reranker), str(engine.scorer.mode), str(getattr(engine.embedder, "name", None)),
             cfg.max_num_batched_tokens, cfg.block_size, _cpu_name(), torch.get_num_threads(), engine.cpu_kernels,
             torch.__version__, quant.extension_name() if engine.cpu_kernels else ""]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def calibrate(engine: "LLMEngine", cache_dir: Path, time_budget_s: float = 20.0,
              load: Callable[[], float] = host_load, force: bool = False) -> Calibration | None:
    """Fit `engine`'s step-time model to this machine (or seed it from the cache, and check that against its first
    real steps); None when its admission policy has no online step-time model (the objective is off, or a policy
    object was given). `load`: the host's load per core now; `force`: measure whatever the cache holds
    (`tandem serve` passes Settings.recalibrate: TANDEM_RECALIBRATE=1)."""
    model = getattr(engine.admission, "model", None)
    if not isinstance(model, OnlineStepTime):
        return None
    path = Path(cache_dir) / "steptime" / f"{cache_key(engine)}.json"
    cached = None if force else _read(path)
    now = load()
    if cached is not None and cached["load"] > LOADED and now <= cached["load"] / 2:
        log.info("the cached step-time fit was measured under load (%.2f a core, now %.2f): measuring it again",
                 cached["load"], now)
        cached = None
    if cached is not None:
        model.seed(cached["coefficients"], cached["spread"])
        engine.add_observer(FitCheck(engine, model, cached["coefficients"], path))
        return Calibration(cached["coefficients"], cached["spread"], 0, 0.0, True, path, cached["load"])
    started = time.monotonic()
    steps, complete = _sweep(engine, started + time_budget_s)
    # The load the sweep ran under: the larger of before and after (the 1-minute average lags, so a job that starts
    # beside the sweep shows only at its end; a fit measured so is recorded as loaded and measured again later).
    now = max(now, load())
    coefficients, spread = model.coefficients(), model.spread()
    model.seed(coefficients, spread)
    result = Calibration(coefficients, spread, steps, time.monotonic() - started, False, path, now)
    if not complete:  # cut short by its time budget (a busy host): the decode shapes come first, so they are in
        log.warning("step-time calibration cut short after %d steps (%.0f s); the online fit refines the rest",
                    steps, result.seconds)
    if now > LOADED:
        log.warning("step-time calibration measured on a busy host (load %.2f a core): it is measured again at a "
                    "start on a quieter host, or with %s=1", now, RECALIBRATE_ENV)
    _write(path, coefficients, spread, steps, now)
    return result


class FitCheck:
    """An engine observer that checks a cached fit against the engine's first CHECK_STEPS real steps: when the
    fit's median relative error on them is over CHECK_MARGIN (measured on another load, or the host changed), the
    online fit those steps refined replaces it in the cache. It then removes itself."""

    def __init__(self, engine: "LLMEngine", model: OnlineStepTime, coefficients: dict[str, float], path: Path,
                 steps: int = CHECK_STEPS, margin: float = CHECK_MARGIN) -> None:
        self.engine, self.model, self.coefficients, self.path = engine, model, coefficients, path
        self.steps, self.margin = steps, margin
        self.errors: list[float] = []
        self.error: float | None = None  # the median relative error, once checked
        self.replaced = False

    def __call__(self, record) -> None:
        if not record.num_seqs or not record.duration_s > 0:
            return
        predicted = OnlineStepTime.predict_with(self.coefficients, StepShape.of_record(record), self.model.wide_rows)
        if predicted > 0:
            self.errors.append(abs(record.duration_s - predicted) / predicted)
        if len(self.errors) < self.steps:
            return
        self.engine.remove_observer(self)
        self.error = statistics.median(self.errors)
        if self.error > self.margin:
            self.replaced = True
            log.warning("the cached step-time fit is off by %.0f%% (median) on the first %d steps: the online fit "
                        "replaces it in %s", 100 * self.error, len(self.errors), self.path)
            _write(self.path, self.model.coefficients(), self.model.spread(), len(self.errors), host_load())


def _write(path: Path, coefficients: dict[str, float], spread: float, steps: int, load: float) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"coefficients": coefficients, "spread": spread, "steps": steps, "load": load}))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: calibrate again next start
        log.warning("step-time calibration not cached (%s)", exc)


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        coefficients = {str(k): float(v) for k, v in data["coefficients"].items()}
        return {"coefficients": coefficients, "spread": float(data["spread"]), "load": float(data.get("load", 0.0))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _sweep(engine: "LLMEngine", deadline: float) -> tuple[int, bool]:
    """Run the calibration workloads; returns the steps run and whether the sweep ran whole (before `deadline`)."""
    ids = _token_ids(engine)
    steps = 0
    serial = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        k = next(serial)  # a distinct first token: no prefix-cache hit between sweep prompts
        return [ids[k % len(ids)]] + [ids[(k * 7 + i) % len(ids)] for i in range(n - 1)]

    def chats(n: int, max_tokens: int, length: int = 32) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            engine.add_request(f"calibrate/{next(serial)}", prompt(length), params)

    def run() -> None:
        nonlocal steps
        while engine.has_unfinished():
            engine.step()
            steps += 1

    # decode rows, and a few past the width where the model's matmuls leave their narrow kernels (the loaded model's
    # narrow_rows), so the fit sees the wide path's jump
    wide = engine.narrow_rows
    past = [wide + 4] if wide is not None and wide + 4 <= engine.scheduler.max_seqs else []
    for rows in (1, 4, 8, *past):
        chats(rows, 6)
        run()
        if time.monotonic() > deadline:
            return steps, False
    # a prompt alone, then a few decodes at its long context: the only decode steps whose context is not ~32 tokens a
    # row, so the fit can tell a context token's price from a row's (without them it priced 8 rows at 256 tokens
    # each at ~140 ms where they take ~25 ms on the embedded model)
    chats(1, 6, length=min(engine.config.max_num_batched_tokens, engine.max_model_len - 8, 384))
    run()
    # decodes beside the other kinds of work: prompts, rerank pairs, embedding rows
    chats(8, 24)
    engine.step()
    steps += 1
    chats(2, 2, length=96)
    text = engine.tokenizer.decode(ids[:48], skip_special_tokens=True)
    engine.add_rerank(f"calibrate/{next(serial)}", "calibration query", [f"{i} {text}" for i in range(8)],
                      RerankParams())
    if engine.embedder is not None:
        engine.add_embed(f"calibrate/{next(serial)}", [f"{i} {text}" for i in range(8)], EmbedParams())
    run()
    return steps, time.monotonic() <= deadline


def _token_ids(engine: "LLMEngine") -> list[int]:
    """Ordinary text's token ids (no special tokens): what the sweep's prompts are made of."""
    text = ("The committee met on Tuesday to review the harvest, the roads and the new school; most of the village "
            "came, asked questions about the budget and stayed for the music afterwards. ") * 4
    ids = [t for t in engine.tokenizer(text, add_special_tokens=False)["input_ids"]
           if t not in engine.eos_token_ids]
    return ids or [0]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
