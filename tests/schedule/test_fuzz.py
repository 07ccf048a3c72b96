"""Property fuzzing (hypothesis, ~30 s in all): ``MegakernelProgram.from_dict`` raises nothing but IRError, and
``validate`` never raises (and is consistent: ok iff no errors) on arbitrary JSON and on randomly edited JSON of
real programs (a lowered toy program and small random DAGs), and on program objects with garbage fields."""
from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedule.adversarial import random_dag, toy_bases
from schedule.ir import IRError, MegakernelProgram
from schedule.validate import ValidationResult, validate

FAST = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
            | st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 31 - 1, -(2 ** 31) - 1])
            | st.floats(allow_nan=True, allow_infinity=False) | st.text(max_size=6)
            | st.sampled_from(["GEMV", "ADD", "activation", "weight", "f32", "1.0", "2.0", "h100"]))
json_values = st.recursive(_scalars, lambda ch: st.lists(ch, max_size=4)
                           | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                               ["tasks", "buffers", "queues", "counters", "target", "format_version", "id", "op",
                                "inputs", "outputs", "waits", "params", "shape", "kind"]), ch, max_size=5),
                           max_leaves=25)


@pytest.fixture(scope="module")
def bases() -> list[dict]:
    toy = toy_bases([dict(num_sms=4)])[0].to_dict()
    rng = random.Random(0)
    return [toy] + [random_dag(rng).to_dict() for _ in range(4)]


def _edit(data, d: dict) -> dict:
    """1-4 random edits of a program dict: replace a value, delete a key / element, duplicate an element."""
    d = copy.deepcopy(d)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        parent, key, node = None, None, d
        while isinstance(node, (dict, list)) and len(node) and data.draw(st.integers(0, 3)) > 0:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            k = keys[data.draw(st.integers(0, len(keys) - 1))]
            parent, key, node = node, k, node[k]
        if parent is None:
            continue
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "dup", "int"]))
        if action == "replace":
            parent[key] = data.draw(json_values)
        elif action == "delete":
            del parent[key]
        elif action == "dup" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif action == "int":
            parent[key] = data.draw(st.sampled_from([-1, 0, 1, 2, 7, 2 ** 31, -(2 ** 31) - 1, 10 ** 12]))
    return d


def _check_validate(obj) -> ValidationResult:
    r = validate(obj)
    assert isinstance(r, ValidationResult)
    assert r.ok == (not r.errors)
    assert isinstance(r.report(), str)
    return r


def _check_from_dict(obj) -> None:
    try:
        p = MegakernelProgram.from_dict(obj)
    except IRError:
        return
    assert isinstance(p, MegakernelProgram)


@FAST
@given(json_values)
def test_from_dict_raises_only_irerror_on_arbitrary_json(v):
    _check_from_dict(v)
    if isinstance(v, dict):
        _check_from_dict({"format_version": "1.0", **v})


@FAST
@given(json_values)
def test_validate_never_raises_on_arbitrary_json(v):
    assert not _check_validate(v).ok
    _check_validate(json.dumps(v))


@FAST
@given(st.data())
def test_from_dict_raises_only_irerror_on_edited_programs(bases, data):
    d = _edit(data, bases[data.draw(st.integers(0, len(bases) - 1))])
    _check_from_dict(d)


@FAST
@given(st.data())
def test_validate_never_raises_on_edited_programs(bases, data):
    d = _edit(data, bases[data.draw(st.integers(0, len(bases) - 1))])
    r = _check_validate(d)
    if r.ok:                           # anything accepted must also parse, and re-validate identically
        assert validate(MegakernelProgram.from_dict(d)).ok


TASK_FIELDS = ["id", "op", "inputs", "outputs", "out_counter", "waits", "params", "sm", "est_bytes", "label"]


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_validate_never_raises_on_garbage_program_objects(bases, data):
    p = MegakernelProgram.from_dict(bases[data.draw(st.integers(0, len(bases) - 1))])
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["task", "buffer", "queue", "list"]))
        val = data.draw(json_values)
        if where == "task":
            t = p.tasks[data.draw(st.integers(0, len(p.tasks) - 1))]
            setattr(t, data.draw(st.sampled_from(TASK_FIELDS)), val)
        elif where == "buffer":
            i = data.draw(st.integers(0, len(p.buffers) - 1))
            f = data.draw(st.sampled_from(["id", "kind", "dtype", "shape", "data", "source"]))
            p.buffers[i] = dataclasses.replace(p.buffers[i], **{f: val})
        elif where == "queue":
            p.queues[data.draw(st.integers(0, len(p.queues) - 1))] = val
        else:                          # a whole field replaced: nothing left to index into, stop editing
            setattr(p, data.draw(st.sampled_from(["tasks", "buffers", "counters", "queues", "target"])), val)
            break
    _check_validate(p)


def test_from_dict_infinity_is_an_irerror(bases):
    d = copy.deepcopy(bases[1])
    d["tasks"][0]["id"] = float("inf")
    with pytest.raises(IRError):
        MegakernelProgram.from_dict(d)


def test_validate_rejects_infinity_without_raising(bases):
    d = copy.deepcopy(bases[1])
    d["buffers"][0]["shape"] = [float("inf")]
    assert not _check_validate(d).ok
    assert not _check_validate(json.dumps(d).replace('"id": 0', '"id": 1e400', 1)).ok
