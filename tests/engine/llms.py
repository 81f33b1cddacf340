"""The engines the engine tests share: make_llm, one engine per distinct configuration per test process, and
assert_no_leaks, what "left as it was found" means. A module of its own, imported by its full name from
tests/engine/conftest.py and from test files alike, so there is one cache: pytest imports that conftest (its folder is
no package) under a name of its own, and the test files import `tests.engine.conftest` again beside it."""
from __future__ import annotations

import os
from collections import OrderedDict

from engine import LLM, EngineConfig

# One engine per distinct configuration per test process (issue #64): a build loads the model (~2 s of a free core,
# several beside other work), and most tests leave the engine as they found it. make_llm hands the same engine to
# every test that asks for the same configuration under the same TANDEM_* variables (the engine reads some at build:
# engine/settings.py), once it has checked that the engine is idle and leak-free and reset what a test can observe
# (_reuse). An engine that is not (a test failed part-way, or left work behind) is dropped and built anew, so one
# test's leftovers never reach another. At most MAX_SHARED are kept, the least recently handed out dropped first: a
# configuration is mostly asked for by one file, and each engine holds its weights and up to 1 GiB of KV pool.
MAX_SHARED = 4
_ENGINES: OrderedDict[tuple[str, tuple], LLM] = OrderedDict()


def make_llm(admission=None, *, fresh: bool = False, **overrides) -> LLM:
    """An engine for a test of the engine's mechanisms: plain budget filling unless the test names an objective
    (`tpot_target_ms`) or a policy, so how many tokens a step takes does not depend on a step-time model fitted to
    this host's timing. The objective's own tests set it (tests/engine/test_admission.py, test_latency_objective.py).

    Shared (see _ENGINES above) unless it cannot be: a fresh engine, never shared, with `fresh=True` (the test changes
    the engine for good, or builds it under patched module state that the key cannot see), with an `admission` policy
    object (the scheduler and the engine both hold the policy, so swapping it is not clean, and a latency policy's
    step-time model and ledger learn from every step) and with a step-time objective (`tpot_target_ms` set: the
    engine's own latency policy learns likewise)."""
    overrides.setdefault("tpot_target_ms", None)
    if fresh or admission is not None or overrides["tpot_target_ms"] is not None:
        return LLM(EngineConfig(**overrides), admission=admission)
    config = EngineConfig(**overrides)  # checked before anything is built; its repr names every field
    key = (repr(config), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("TANDEM_"))))
    llm = _ENGINES.pop(key, None)
    if llm is None or not _reuse(llm):
        llm = LLM(config)
    _ENGINES[key] = llm
    while len(_ENGINES) > MAX_SHARED:
        _ENGINES.popitem(last=False)
    return llm


def _reuse(llm: LLM) -> bool:
    """Make a shared engine look new to the next test: True once it is idle and leak-free (assert_no_leaks), its
    step observers removed and its prefix cache emptied (a test counting cached tokens sees only its own); False
    (drop it) if it is not idle or leaks."""
    eng = llm.engine
    try:
        assert not eng.has_unfinished()
        assert_no_leaks(llm)
    except AssertionError:
        return False
    for fn in list(eng._observers):  # the engine has no "remove all"; the tests' recorders are all there is
        eng.remove_observer(fn)
    pool = eng.pool
    for _ in range(pool.num_blocks):  # each free block in turn: allocate evicts its hash, release requeues it
        pool.release(pool.allocate(1))
    assert pool.num_cached == 0 and pool.num_free == pool.num_blocks
    return True


def assert_no_leaks(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert all(rc == 0 for rc in llm.engine.pool.ref_counts)
    assert stats["staged_rows"] == 0 and stats["staged_bytes"] == 0, stats  # no encoder row's states outlive it
