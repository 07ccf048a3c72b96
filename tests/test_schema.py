"""schemas/schedule_config.schema.json is generated from KNOBS, and it agrees with the Python checks."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from flywheel import prior
from flywheel.schema import SCHEMA_PATH, knob_table_markdown, render, schedule_config_schema
from schedule.ir import IRError, ScheduleConfig

SCHEMA = schedule_config_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _ok(cfg) -> bool:
    return VALIDATOR.is_valid(cfg)


def test_committed_schema_equals_generated():
    assert SCHEMA_PATH.is_file(), "run: python -m flywheel.schema --write"
    assert SCHEMA_PATH.read_text() == render(), "stale schema: run python -m flywheel.schema --write"


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_PATH.read_text()))
    assert SCHEMA["additionalProperties"] is False
    assert list(SCHEMA["properties"]) == [k.name for k in prior.KNOBS]


def test_defaults_and_samples_validate():
    assert _ok({}) and _ok(prior.defaults())
    rng = random.Random(0)
    for _ in range(50):
        assert _ok(prior.random_config(rng))


@pytest.mark.parametrize("bad", [{"nope": 1}, {"gemv_rows": "16"}, {"gemv_rows": 7}, {"gemv_rows": True},
                                 {"threads_per_block": 500}, {"threads_per_block": 2048}, {"fuse_norm": 1},
                                 {"sm_assignment": "random"}, {"attn_splits": -1}, {"num_sms": -1},
                                 {"prefetch_depth": 2.5}])
def test_schema_rejects_malformed(bad):
    assert not _ok(bad)
    with pytest.raises(IRError):
        ScheduleConfig.from_dict(bad)


VALUES = st.one_of(st.integers(-5, 2000), st.booleans(), st.sampled_from(["list", "lpt", "x", "16"]),
                   st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=300, deadline=None, database=None)
@given(st.sampled_from([k.name for k in prior.KNOBS]), VALUES)
def test_schema_agrees_with_knob_check(name, value):
    # JSON Schema calls 2.0 an integer; the harness does not (an agent gets "expected an integer"). The one
    # deliberate difference: the Python check is stricter there.
    if isinstance(value, float) and value.is_integer() and prior.KNOB_BY_NAME[name].type is int:
        assert prior.KNOB_BY_NAME[name].check(value) is not None
        return
    py_ok = prior.KNOB_BY_NAME[name].check(value) is None
    assert _ok({name: value}) == py_ok, (name, value)


def test_knob_table_lists_every_knob_and_harness_md_is_current():
    table = knob_table_markdown()
    for k in prior.KNOBS:
        assert f"`{k.name}`" in table
    harness_md = (SCHEMA_PATH.parent.parent / "HARNESS.md").read_text()
    assert table in harness_md, "HARNESS.md knob table is stale: paste `python -m flywheel.schema --table`"
