"""The single source of schedule knobs: their choices, defaults and meaning (plus the learned prior in later code).

``ScheduleConfig`` (schedule/ir.py), ``harness.search_space()`` and ``schemas/schedule_config.schema.json`` are all
derived from ``KNOBS``. Every knob changes the lowered program or the kernel build; tests/schedule/test_knobs.py
proves it knob by knob.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: Any
    choices: tuple = ()            # allowed values (ints / strings / bools); empty when a range is given
    range: tuple[int, int] | None = None   # inclusive [lo, hi] for ints
    multiple_of: int = 1
    affects: str = "program"       # "program" (lowering) or "build" (kernel compile flags / launch)
    doc: str = ""

    def check(self, value: Any) -> str | None:
        """None if ``value`` is acceptable, else a message naming the knob."""
        if self.type is bool:
            if not isinstance(value, bool):
                return f"{self.name}: expected a boolean, got {type(value).__name__} {value!r}"
            return None
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{self.name}: expected an integer, got {type(value).__name__} {value!r}"
        elif self.type is str and not isinstance(value, str):
            return f"{self.name}: expected a string, got {type(value).__name__} {value!r}"
        if self.choices and value not in self.choices:
            return f"{self.name}: {value!r} is not one of {list(self.choices)}"
        if self.range is not None and not (self.range[0] <= value <= self.range[1]):
            return f"{self.name}: {value} is outside [{self.range[0]}, {self.range[1]}]"
        if self.type is int and self.multiple_of > 1 and value % self.multiple_of:
            return f"{self.name}: {value} is not a multiple of {self.multiple_of}"
        return None


KNOBS: tuple[Knob, ...] = (
    Knob("gemv_rows", int, 16, choices=(4, 8, 16, 32, 64, 128),
         doc="output rows per GEMV task for o_proj and down_proj (smaller = more, finer tasks)"),
    Knob("mlp_rows", int, 32, choices=(4, 8, 16, 32, 64, 128),
         doc="output rows per fused gate/up (SiLU*up) task"),
    Knob("lm_head_rows", int, 64, choices=(16, 32, 64, 128, 256, 512),
         doc="vocabulary rows per LM-head task"),
    Knob("qkv_heads", int, 1, choices=(1, 2, 4, 8),
         doc="query heads per QKV task (a task never straddles a KV group); K and V are one head per task"),
    Knob("attn_splits", int, 1, range=(1, 64),
         doc="split-KV: the sequence of each KV head is split across this many tasks, merged by online softmax"),
    Knob("sm_assignment", str, "list", choices=("list", "lpt", "round_robin"),
         doc="task->SM policy: 'list' = dependency-aware earliest finish, 'lpt' = balance bytes greedily, "
             "'round_robin' = task i on SM i mod n"),
    Knob("num_sms", int, 0, range=(0, 1024),
         doc="SMs (persistent blocks) to use; 0 = all SMs of the target"),
    Knob("fuse_norm", bool, True, choices=(True, False),
         doc="recompute RMSNorm inside each consuming GEMV task instead of a separate RMSNORM task"),
    Knob("fuse_residual", bool, True, choices=(True, False),
         doc="add the residual inside the o_proj/down_proj tile instead of separate ADD tasks"),
    Knob("threads_per_block", int, 512, range=(128, 1024), multiple_of=32, affects="build",
         doc="threads per persistent block (kernel build flag and launch)"),
    Knob("prefetch_depth", int, 2, range=(0, 4), affects="build",
         doc="how many queued tasks ahead each block prefetches weights into L2 (0 = no prefetch)"),
)
KNOB_BY_NAME = {k.name: k for k in KNOBS}


def defaults() -> dict[str, Any]:
    return {k.name: k.default for k in KNOBS}


def search_space() -> list[dict]:
    """Every knob with its choices or range, default, and one-line meaning (documented in HARNESS.md)."""
    out = []
    for k in KNOBS:
        d = {"name": k.name, "type": k.type.__name__, "default": k.default, "affects": k.affects, "doc": k.doc}
        if k.choices:
            d["choices"] = list(k.choices)
        if k.range:
            d["range"] = list(k.range)
        if k.multiple_of > 1:
            d["multiple_of"] = k.multiple_of
        out.append(d)
    return out
