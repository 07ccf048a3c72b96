"""Issue 7: the independent oracle (schedule/oracle.py), the mutation generator (schedule/adversarial.py) and a
CI-sized validator-vs-oracle run that must show zero false accepts (false rejects are counted, not failed)."""
from __future__ import annotations

import pathlib
import random
import subprocess
import sys

import pytest

from schedule import oracle
from schedule.adversarial import (MUTATIONS, SRC, add_task, generate, make_program, mutate, norm_task, random_dag,
                                  small_buffers, toy_bases)
from schedule.validate import validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
A0, A1, A2, OUT = 3, 4, 5, 6


def prog(tasks, n_counters, n_sms=None):
    return make_program(small_buffers(3), tasks, n_counters, n_sms)


@pytest.fixture(scope="module")
def bases():
    return toy_bases()


# -- the oracle on hand-built programs -----------------------------------------------------------------------------
def test_oracle_accepts_a_valid_chain():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), add_task(1, A0, A0, A1, waits=[(0, 1)], out=1, sm=1),
              norm_task(2, A1, OUT, waits=[(1, 1)], sm=0)], 2)
    r = oracle.check(p)
    assert r.ok, r.summary()


def test_oracle_finds_unordered_writers_and_unordered_read():
    p = prog([add_task(0, SRC, SRC, A0, 0, 6, out=0, sm=0), add_task(1, SRC, SRC, A0, 4, 4, sm=1),
              norm_task(2, A0, OUT, waits=[(0, 1)], sm=2)], 1)
    r = oracle.check(p)
    assert not r.ok and any("write/write" in m for m in r.findings["race"])
    assert any("task 1" in m and "task 2" in m for m in r.findings["race"])   # the read of task 1's write


def test_oracle_finds_deadlock():
    p = prog([add_task(0, SRC, SRC, A0, waits=[(1, 1)], out=0, sm=0),
              add_task(1, SRC, SRC, A1, waits=[(0, 1)], out=1, sm=1), norm_task(2, SRC, OUT, sm=2)], 2)
    r = oracle.check(p)
    assert r.categories == ["deadlock"], r.summary()


def test_oracle_under_counted_wait_with_a_late_producer():
    """Both producers normally run before the reader, but the reader only waits for one: the oracle must find
    the order in which the missing producer is late (exhaustively for a tiny program, by delay for a larger)."""
    tasks = [add_task(0, SRC, SRC, A0, 0, 4, out=0, sm=0), add_task(1, SRC, SRC, A0, 4, 4, out=0, sm=1),
             norm_task(2, A0, OUT, waits=[(0, 1)], sm=2)]
    r = oracle.check(prog(tasks, 1))
    assert r.exhaustive and "race" in r.categories, r.summary()
    r = oracle.check(prog(tasks, 1), exhaustive_tasks=0)
    assert "race" in r.categories and r.runs > 1, r.summary()


def test_oracle_under_counted_but_covered_by_queue_order_is_clean():
    """The validator's contract rejects this (threshold 1 < 2 producers) but no execution misbehaves: the reader
    only reads the tile its own SM produced before it. This is the kind of case counted as a false reject.
    (Reading both tiles would race: the one increment it waits for may be its own SM's.)"""
    tasks = [add_task(0, SRC, SRC, A0, 0, 4, out=0, sm=0), add_task(1, SRC, SRC, A0, 4, 4, out=0, sm=1),
             add_task(2, A0, A0, A1, 4, 4, waits=[(0, 1)], sm=1), norm_task(3, SRC, OUT, sm=2)]
    racy = [*tasks[:2], norm_task(2, A0, OUT, waits=[(0, 1)], sm=1)]
    assert "race" in oracle.check(prog(racy, 1)).categories
    r = oracle.check(prog(tasks, 1))
    assert r.ok and r.exhaustive, r.summary()
    assert not validate(prog(tasks, 1)).ok


def test_oracle_uninit_and_malformed_and_readonly():
    assert "uninit" in oracle.check(prog([norm_task(0, A0, OUT)], 0)).categories
    assert "uninit" in oracle.check(prog([add_task(0, SRC, SRC, A0)], 0)).categories   # 'out' never written
    bad = prog([add_task(0, SRC, SRC, A0, out=0), norm_task(1, A0, OUT, waits=[(0, 1)], sm=1)], 1)
    bad.tasks[1].inputs.append(A0)
    assert oracle.check(bad).categories == ["malformed"]
    ro = prog([add_task(0, SRC, SRC, SRC), norm_task(1, SRC, OUT)], 0)
    assert "readonly" in oracle.check(ro).categories


def test_oracle_finds_a_clobbered_kv_cache(bases):
    from schedule.adversarial import clone
    p = clone(bases[0])
    k0, k1 = p.buffer("k_cache0").id, p.buffer("k_cache1").id
    for t in p.tasks:
        t.outputs = [k0 if b == k1 else b for b in t.outputs]
        t.inputs = [k0 if b == k1 else b for b in t.inputs]
    r = oracle.check(p)
    assert r.categories == ["clobber"], r.summary()


@pytest.mark.parametrize("junk", [None, [], {"tasks": 5}, "x", {"format_version": "1.0"}])
def test_oracle_never_raises(junk):
    r = oracle.check(junk)
    assert not r.ok and r.categories == ["malformed"]


def test_oracle_accepts_lowered_toy_programs(bases):
    for p in bases:
        r = oracle.check(p)
        assert r.ok and r.runs == 1, r.summary()


def test_oracle_is_independent_of_the_validator():
    src = (ROOT / "schedule" / "oracle.py").read_text()
    assert "validate" not in src.replace("validate.py", ""), "oracle.py must not use the validator"
    assert "happens_before_edges" not in src and "topological_order" not in src


# -- the generator ---------------------------------------------------------------------------------------------------
def test_random_dags_are_valid_for_both_judges():
    rng = random.Random(5)
    for _ in range(300):
        p = random_dag(rng)
        assert validate(p).ok, validate(p).report()
        assert oracle.check(p).ok, oracle.check(p).summary()
        assert 3 <= len(p.tasks) <= 12


def test_generation_is_deterministic(bases):
    a = [(b, k, d, p.to_dict()) for b, k, d, p in generate(42, 120, bases=bases)]
    b = [(b, k, d, p.to_dict()) for b, k, d, p in generate(42, 120, bases=bases)]
    assert a == b
    c = [d for _, _, d, _ in generate(43, 120, bases=bases)]
    assert c != [d for _, _, d, _ in a]


def test_every_mutation_applies_to_a_lowered_program_and_leaves_the_base_alone(bases):
    base = bases[1]
    before = base.to_dict()
    rng = random.Random(0)
    for kind in MUTATIONS:
        k, desc, mut = mutate(base, rng, kind)
        assert k == kind and desc and mut is not base
    assert base.to_dict() == before


def test_mutations_mostly_break_programs(bases):
    """Sanity of the benchmark: most mutants are actually bad (else zero false accepts would mean little)."""
    bad = sum(not oracle.check(p).ok for _, _, _, p in generate(7, 200, bases=bases))
    assert bad > 100


# -- validator vs oracle ----------------------------------------------------------------------------------------------
def test_no_false_accepts_ci_run(bases):
    """10,000 adversarial schedules (~45 s on one core): the validator never accepts a program in which the oracle finds a deadlock,
    race, uninitialised read or an unrunnable task. False rejects (contract stricter than behaviour) are counted."""
    false_acc, false_rej, rejected = [], 0, 0
    for base, kind, desc, p in generate(2026, 10_000, bases=bases):
        v, o = validate(p), oracle.check(p)
        rejected += not v.ok
        if v.ok and not o.ok:
            false_acc.append(f"{base} {kind}: {desc}: {o.summary()}")
        false_rej += (not v.ok) and o.ok
    assert not false_acc, "\n".join(false_acc[:10])
    assert rejected > 5000 and false_rej < 500, (rejected, false_rej)


def test_report_script_runs_and_saves_cases(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "adversarial_report.py"), "-n", "300",
                          "--workers", "1", "--seed", "1", "--out-dir", str(tmp_path / "cases"),
                          "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "false accepts 0" in out.stdout and "TOTAL" in out.stdout
    import json
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["schedules"] == 300 and s["false_accepts"] == 0
    saved = list((tmp_path / "cases").glob("*.json")) if (tmp_path / "cases").exists() else []
    assert len(saved) == s["false_rejects"]
