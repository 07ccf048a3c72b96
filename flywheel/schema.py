"""Render the ScheduleConfig JSON Schema (draft 2020-12) and the HARNESS.md knob table from ``prior.KNOBS``.

    python -m flywheel.schema            # print the schema
    python -m flywheel.schema --write    # (re)write schemas/schedule_config.schema.json
    python -m flywheel.schema --check    # exit 1 if the committed file differs from KNOBS
    python -m flywheel.schema --table    # print the markdown knob table

The committed schema is generated, never hand-edited; tests/test_schema.py checks it equals ``render()``.
"""
from __future__ import annotations

import json
import pathlib
import sys

from flywheel.prior import KNOBS

SCHEMA_PATH = pathlib.Path(__file__).resolve().parent.parent / "schemas" / "schedule_config.schema.json"
_JSON_TYPES = {bool: "boolean", int: "integer", str: "string", float: "number"}


def schedule_config_schema() -> dict:
    props = {}
    for k in KNOBS:
        p: dict = {"type": _JSON_TYPES[k.type], "default": k.default,
                   "description": f"{k.doc} [affects: {k.affects}]"}
        if k.choices and k.type is not bool:
            p["enum"] = list(k.choices)
        if k.range is not None:
            p["minimum"], p["maximum"] = k.range
        if k.multiple_of > 1:
            p["multipleOf"] = k.multiple_of
        props[k.name] = p
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://amk.invalid/schemas/schedule_config.schema.json",
            "title": "ScheduleConfig",
            "description": "The AMK schedule search surface: one value per knob (omitted knobs take their default). "
                           "Generated from flywheel/prior.py KNOBS by `python -m flywheel.schema --write`. "
                           "GPU-dependent limits (num_sms <= SMs, threads_per_block <= max, shared memory) are "
                           "checked by `harness.evaluate`, not by this schema.",
            "type": "object", "additionalProperties": False, "properties": props}


def render() -> str:
    return json.dumps(schedule_config_schema(), indent=2) + "\n"


def knob_table_markdown() -> str:
    rows = ["| knob | type | default | allowed | affects | meaning |", "|---|---|---|---|---|---|"]
    for k in KNOBS:
        if k.choices:
            allowed = ", ".join(json.dumps(c) for c in k.choices)
        else:
            allowed = f"{k.range[0]}..{k.range[1]}" + (f", multiple of {k.multiple_of}" if k.multiple_of > 1 else "")
        rows.append(f"| `{k.name}` | {k.type.__name__} | `{json.dumps(k.default)}` | {allowed} | {k.affects} "
                    f"| {k.doc} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--write" in argv:
        SCHEMA_PATH.parent.mkdir(parents=True, exist_ok=True)
        SCHEMA_PATH.write_text(render())
        print(f"wrote {SCHEMA_PATH}")
    elif "--check" in argv:
        ok = SCHEMA_PATH.is_file() and SCHEMA_PATH.read_text() == render()
        print(f"{SCHEMA_PATH}: {'up to date' if ok else 'STALE: run python -m flywheel.schema --write'}")
        return 0 if ok else 1
    elif "--table" in argv:
        print(knob_table_markdown(), end="")
    else:
        print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
