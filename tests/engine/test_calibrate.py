"""Start-up calibration (engine/calibrate.py): a sweep of real steps fits the objective's step-time model, is cached
per model and host, and seeds a later engine at once; a sweep cut short by its time budget still fits the decode
shapes it ran first."""
from __future__ import annotations

import json

from engine.calibrate import calibrate, cache_key
from engine.step_time import FEATURES, OnlineStepTime, StepShape
from tests.engine.conftest import make_llm, record_steps


def test_a_sweep_fits_the_model_caches_it_and_a_later_engine_is_seeded_from_the_cache(tmp_path):
    first = make_llm(tpot_target_ms="auto")
    model = first.engine.admission.model
    assert not model.ready
    records = record_steps(first)
    measured = calibrate(first.engine, tmp_path, time_budget_s=1e9)  # the whole sweep, however busy the host
    assert measured is not None and not measured.cached and measured.steps >= 20
    # decode steps at short and long contexts, so that the fit can tell a context token's price from a row's
    per_row = [r.decode_context_tokens / r.decode_tokens for r in records if r.decode_tokens]
    assert min(per_row) < 64 and max(per_row) > 256
    assert model.ready and model.coefficients() == measured.coefficients
    assert not first.engine.has_unfinished() and first.engine.stats()["num_running"] == 0  # the sweep is gone
    stored = json.loads(measured.path.read_text())
    assert set(stored["coefficients"]) == set(FEATURES) and stored["steps"] == measured.steps
    # what the fit says a step of 8 decodes and a prompt chunk cost: real time, whatever the split between the
    # coefficients (a busy host's noise can fit one of them at 0; every step it saw took time)
    assert OnlineStepTime.predict_with(measured.coefficients, StepShape(decode_rows=8, decode_context_tokens=512)) > 0
    assert OnlineStepTime.predict_with(measured.coefficients, StepShape(prefill_tokens=256)) > 0
    assert "step-time model (measured in" in measured.summary()

    second = make_llm(tpot_target_ms="auto")
    assert cache_key(second.engine) == cache_key(first.engine)
    seeded = calibrate(second.engine, tmp_path)
    assert seeded.cached and seeded.steps == 0 and seeded.coefficients == measured.coefficients
    assert second.engine.admission.model.ready  # plans from its first step
    # a fixed objective calibrates the same model; with the objective off there is nothing to calibrate
    assert calibrate(make_llm(tpot_target_ms=None).engine, tmp_path) is None


def test_a_sweep_cut_short_by_its_budget_still_fits_the_decode_shapes_it_ran(tmp_path):
    llm = make_llm(tpot_target_ms="auto")
    cut = calibrate(llm.engine, tmp_path, time_budget_s=0.0)  # stops after its first phase (one decode row)
    assert cut is not None and not cut.cached and 0 < cut.steps < 20
    assert llm.engine.admission.model.ready
    assert OnlineStepTime.predict_with(cut.coefficients, StepShape(decode_rows=1, decode_context_tokens=32)) > 0
    assert not llm.engine.has_unfinished()
