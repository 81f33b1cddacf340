"""Start-up calibration (engine/calibrate.py): a sweep of real steps fits the objective's step-time model, is cached
per model and host, and seeds a later engine at once; a sweep cut short by its time budget still fits the decode
shapes it ran first."""
from __future__ import annotations

import json

import pytest

from engine.calibrate import calibrate, cache_key
from engine.step_time import FEATURES, OnlineStepTime, StepShape
from tests.engine.conftest import make_llm, record_steps


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One whole sweep on a fresh engine (however busy the host), its steps and its result: the sweep's own test
    checks it, and the cached-fit test takes its coefficients as a real fit instead of sweeping again (the whole
    sweep is most of each of those tests)."""
    cache_dir = tmp_path_factory.mktemp("calibrate")
    first = make_llm(tpot_target_ms="auto")
    was_ready = first.engine.admission.model.ready
    records = record_steps(first)
    measured = calibrate(first.engine, cache_dir, time_budget_s=1e9)
    return first, was_ready, records, measured, cache_dir


def test_a_sweep_fits_the_model_caches_it_and_a_later_engine_is_seeded_from_the_cache(swept):
    first, was_ready, records, measured, tmp_path = swept
    model = first.engine.admission.model
    assert not was_ready
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


def test_a_fit_cached_under_load_is_measured_again_on_a_quieter_host(tmp_path):
    """A fit measured at load 2.0 a core is cached with that load; a later start on a host at 0.1 measures again
    (and caches the quiet fit), while a start as busy as the first takes the cache."""
    first = make_llm(tpot_target_ms="auto")
    busy = calibrate(first.engine, tmp_path, time_budget_s=0.0, load=lambda: 2.0)
    assert not busy.cached and json.loads(busy.path.read_text())["load"] == 2.0
    assert "load 2.00 a core" in busy.summary() and "TANDEM_RECALIBRATE=1" in busy.summary()
    again_busy = calibrate(make_llm(tpot_target_ms="auto").engine, tmp_path, load=lambda: 1.9)
    assert again_busy.cached
    quiet = calibrate(make_llm(tpot_target_ms="auto").engine, tmp_path, time_budget_s=0.0, load=lambda: 0.1)
    assert not quiet.cached and quiet.steps > 0
    assert json.loads(quiet.path.read_text())["load"] == 0.1
    forced = calibrate(make_llm(tpot_target_ms="auto").engine, tmp_path, time_budget_s=0.0, load=lambda: 0.1,
                       force=True)
    assert not forced.cached


def test_a_load_that_rose_during_the_sweep_is_the_load_its_fit_is_cached_with(tmp_path):
    """A job that starts beside the sweep shows in the 1-minute load average only at the sweep's end: the fit is
    cached with that load, so a later start on a quiet host measures it again."""
    loads = iter([0.2, 1.6])
    rose = calibrate(make_llm(tpot_target_ms="auto").engine, tmp_path, time_budget_s=0.0, load=lambda: next(loads))
    assert not rose.cached and json.loads(rose.path.read_text())["load"] == 1.6
    quiet = calibrate(make_llm(tpot_target_ms="auto").engine, tmp_path, time_budget_s=0.0, load=lambda: 0.2)
    assert not quiet.cached


def test_a_cached_fit_far_off_the_first_real_steps_is_replaced_by_the_online_fit(swept, tmp_path):
    """A cached fit that prices every step 20x too high (as one measured on a loaded host does) is checked against
    the first real steps: its median error is over the margin, so the online fit those steps refined replaces it in
    the cache; a cached fit close to the real steps stays."""
    from engine.calibrate import CHECK_STEPS, FitCheck
    from tests.engine.conftest import run_to_end
    from engine import SamplingParams

    measured = swept[3]  # a whole sweep's fit of this engine (its own cache folder is the fixture's)
    inflated = {k: 20 * v for k, v in measured.coefficients.items()}
    second = make_llm(tpot_target_ms="auto")
    path = tmp_path / "steptime" / f"{cache_key(second.engine)}.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"coefficients": inflated, "spread": 0.0, "steps": 1, "load": 0.0}))
    seeded = calibrate(second.engine, tmp_path, load=lambda: 0.0)
    assert seeded.cached and seeded.coefficients == inflated
    check = next(fn for fn in second.engine._observers if isinstance(fn, FitCheck))
    for i in range(6):
        second.engine.add_request(f"r{i}", "Tell me about bees.", SamplingParams(max_tokens=CHECK_STEPS + 8, ignore_eos=True))
    run_to_end(second.engine)
    assert len(check.errors) == CHECK_STEPS and check.error > 0.5 and check.replaced
    assert check not in second.engine._observers  # it checked once, and went
    stored = json.loads(seeded.path.read_text())["coefficients"]
    shape = StepShape(decode_rows=6, decode_context_tokens=6 * 20)
    assert OnlineStepTime.predict_with(stored, shape) < OnlineStepTime.predict_with(inflated, shape) / 4
