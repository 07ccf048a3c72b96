"""Helpers of the lowering tests (tests/schedule/test_knobs.py, test_auto_rules.py): the toy and two preset shapes
(meta tensors: no weights), the H100 target, a program's structure without its config / meta, task counts."""
from __future__ import annotations

import json

from schedule.graph import load_model
from schedule.ir import get_target

TOY = load_model("toy", dtype="f32")
H100 = get_target("h100")
# knobs whose values differ only on bigger tiles than the toy's are compared on these shapes
LLAMA1B = load_model("llama-3.2-1b", dtype="bf16", device="meta")
QWEN06 = load_model("qwen3-0.6b", dtype="bf16", device="meta")


def structure(prog) -> str:
    """The program as JSON without ``config`` / ``meta`` (which would differ trivially between two configs)."""
    d = prog.to_dict()
    d.pop("config"), d.pop("meta")
    return json.dumps(d, sort_keys=True)


def count(prog, op=None, label=None) -> int:
    """Tasks of opcode ``op`` (any if None) whose label contains ``label`` (any if None)."""
    return sum(1 for t in prog.tasks if (op is None or t.op == op) and (label is None or label in t.label))


LOADED = {"toy": TOY, "llama-3.2-1b": LLAMA1B, "qwen3-0.6b": QWEN06}


def model(name: str):
    """The toy, or a preset's shapes on meta tensors (loaded once)."""
    if name not in LOADED:
        LOADED[name] = load_model(name, dtype="bf16", device="meta")
    return LOADED[name]
