"""Helpers of the validator tests (tests/schedule/test_validate*.py): hand-built programs over
schedule.adversarial's small buffers, the rejection check (every needle named in the report) and the toy model."""
from __future__ import annotations

import pytest

from schedule.adversarial import SRC, add_task, make_program, norm_task, small_buffers
from schedule.validate import ValidationResult, validate

A0, A1, A2, OUT = 3, 4, 5, 6          # small_buffers(3): a0, a1, a2, out


def prog(tasks, n_counters, n_sms=None):
    return make_program(small_buffers(3), tasks, n_counters, n_sms)


def chain():
    """a0 = src + src (SM 0) -> a1 = a0 + a0 (SM 1) -> out = rmsnorm(a1) (SM 0)."""
    return prog([add_task(0, SRC, SRC, A0, out=0, sm=0),
                 add_task(1, A0, A0, A1, waits=[(0, 1)], out=1, sm=1),
                 norm_task(2, A1, OUT, waits=[(1, 1)], sm=0)], 2)


def rejected(p, *needles) -> str:
    r = validate(p)
    assert isinstance(r, ValidationResult) and not r.ok, r.report()
    text = "\n".join(r.errors)
    for nd in needles:
        assert nd in text, f"{nd!r} not in:\n{r.report()}"
    return text


@pytest.fixture(scope="module")
def toy():
    from schedule.graph import load_model
    return load_model("toy", dtype="f32", seed=0)
