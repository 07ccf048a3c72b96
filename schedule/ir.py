"""The schedule IR: buffers, monotonic counters, tasks queued per SM, GPU targets, the schedule config, JSON I/O.

A ``MegakernelProgram`` is one decode step of one model for one GPU: every buffer it touches, every counter,
every task (one VM instruction), and ``queues[sm]`` = the task ids that SM's persistent block runs, in order.

Synchronisation contract (what the validator proves and both VMs implement):
  * counters are 0 when a step starts (the GPU launch's last block resets them for the next); a task with ``out_counter = c`` increments c by one after all its writes
    (release); a ``Wait(c, t)`` blocks until c >= t (acquire), and t must equal the number of producers of c.
  * a block runs its queue in order, so queue order is also a happens-before edge.

``validate(program)`` (in ``schedule/validate.py``) never raises; it returns a ``ValidationResult``.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

FORMAT_VERSION = "1.1"


class IRError(ValueError):
    """A malformed program, config or target (the message names the field)."""


class DType(str, enum.Enum):
    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    I32 = "i32"

    @property
    def nbytes(self) -> int:
        return {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}[self.value]


class BufferKind(str, enum.Enum):
    WEIGHT = "weight"          # from the checkpoint, read-only
    ACTIVATION = "activation"  # per-step scratch, written then read inside the step (poisoned before each step)
    KV_CACHE = "kv_cache"      # persists across steps
    IO_INPUT = "io_input"      # written by the host/device loop between launches (token id, position; a launch of
                               # N steps (steps_per_launch) also has 'pos@1'..'pos@N-1', step s's position pos + s)
    IO_OUTPUT = "io_output"    # read after the launch (logits, next token; step s >= 1: 'logits@s', 'next_token@s')
    CONST = "const"            # small tables computed at lowering (RoPE inverse frequencies), stored in the program


class MemSpace(str, enum.Enum):
    """Cache policy hint for the device: how a buffer's bytes flow through L2."""
    STREAM = "stream"          # read once per step (weights): evict-first, prefetch ahead
    RESIDENT = "resident"      # small, hot, read and written in the step (activations, IO, consts)
    PERSISTENT = "persistent"  # large, long-lived state (KV cache)


class InstructionKind(str, enum.Enum):
    EMBED = "embed"
    NORM = "norm"
    GEMV = "gemv"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    REDUCE = "reduce"
    PREFETCH = "prefetch"


@dataclasses.dataclass
class Buffer:
    id: int
    name: str
    kind: BufferKind
    dtype: DType
    shape: tuple[int, ...]
    source: str | None = None        # state-dict key for WEIGHT buffers
    space: MemSpace = MemSpace.RESIDENT
    data: list[float] | None = None  # inline values for CONST buffers
    # WEIGHT only: the buffer holds columns [cols[0], cols[0] + cols[1]) of its 2-D source, stored contiguously
    # (o_proj split by KV group: each group's column block is one contiguous [n, cols] matrix)
    cols: tuple[int, int] | None = None
    # ACTIVATION only (knob flag_hops): data-flagged fp32 -- on the device each element is an 8-byte word holding
    # the value and the tag of the launch that wrote it, stored without a fence; readers poll the words themselves
    # (vm/csrc/sync.cuh). The values are the same; validate.py checks who may write and read it and how.
    flagged: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.nbytes

    def to_dict(self) -> dict:
        d = {"id": self.id, "name": self.name, "kind": self.kind.value, "dtype": self.dtype.value,
             "shape": list(self.shape), "source": self.source, "space": self.space.value}
        if self.data is not None:
            d["data"] = list(self.data)
        if self.cols is not None:
            d["cols"] = list(self.cols)
        if self.flagged:
            d["flagged"] = True
        return d

    @staticmethod
    def from_dict(d: dict) -> "Buffer":
        return Buffer(int(d["id"]), str(d["name"]), BufferKind(d["kind"]), DType(d["dtype"]),
                      tuple(int(s) for s in d["shape"]), d.get("source"), MemSpace(d.get("space", "resident")),
                      None if d.get("data") is None else [float(x) for x in d["data"]],
                      None if d.get("cols") is None else (int(d["cols"][0]), int(d["cols"][1])),
                      bool(d.get("flagged", False)))

    @property
    def storage_key(self) -> tuple:
        """What identifies a WEIGHT buffer's bytes: its source and column slice (tied weights share a key)."""
        return (self.source or self.name, self.cols)


def find_weight(b: Buffer, weights: dict, error: type[Exception] = IRError):
    """The tensor behind WEIGHT buffer ``b`` (by its state-dict key), checked against the program's shape."""
    if b.source not in weights:
        raise error(f"buffer {b.id} '{b.name}': weight '{b.source}' is missing")
    w = weights[b.source]
    if b.cols is not None:
        c0, cn = b.cols
        if len(w.shape) != 2 or not (0 <= c0 and cn >= 1 and c0 + cn <= w.shape[1]):
            raise error(f"buffer {b.id} '{b.name}': columns [{c0}, {c0 + cn}) of weight '{b.source}' "
                        f"(shape {tuple(w.shape)}) do not exist")
        w = w[:, c0:c0 + cn]
    if tuple(w.shape) != tuple(b.shape):
        raise error(f"buffer {b.id} '{b.name}': weight '{b.source}' has shape {tuple(w.shape)}, "
                    f"program expects {tuple(b.shape)}")
    return w


@dataclasses.dataclass
class Counter:
    """A monotonic int32, zero at the start of every step. Producers increment it once each (their out_counter);
    waiters wait for thresholds. A claim counter (a GEMV_SILU_MUL claim group's dyn_claim) is the one other use: its
    members draw tickets from it with atomic adds, and no task waits on it or signals it (validate.py)."""
    id: int
    name: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name}

    @staticmethod
    def from_dict(d: dict) -> "Counter":
        return Counter(int(d["id"]), str(d.get("name", "")))


@dataclasses.dataclass
class Wait:
    counter: int
    threshold: int
    # data: the wait only orders data-flagged inputs (Buffer.flagged), which the task's op polls itself; the kernel
    # looks at the counter once (to prefetch weights while the data is not there) and never spins on it. For memory
    # ordering it is no happens-before edge: validate.py proves the program without it (the producer still signals)
    data: bool = False

    def to_dict(self) -> dict:
        d = {"counter": self.counter, "threshold": self.threshold}
        if self.data:
            d["data"] = True
        return d

    @staticmethod
    def from_dict(d: dict) -> "Wait":
        return Wait(int(d["counter"]), int(d["threshold"]), bool(d.get("data", False)))


@dataclasses.dataclass
class Task:
    id: int
    op: str                          # opcode name, a key of vm.abi.OPCODES
    inputs: list[int]                # buffer ids, in the opcode's slot order
    outputs: list[int]
    out_counter: int = -1            # counter incremented once when done; -1 = none
    waits: list[Wait] = dataclasses.field(default_factory=list)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    sm: int = 0
    est_bytes: int = 0               # bytes this task must move from HBM (weights + KV), for balance and cost
    est_flops: int = 0
    label: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "op": self.op, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "out_counter": self.out_counter, "waits": [w.to_dict() for w in self.waits],
                "params": dict(self.params), "sm": self.sm, "est_bytes": self.est_bytes,
                "est_flops": self.est_flops, "label": self.label}

    @staticmethod
    def from_dict(d: dict) -> "Task":
        return Task(int(d["id"]), str(d["op"]), [int(x) for x in d["inputs"]], [int(x) for x in d["outputs"]],
                    int(d.get("out_counter", -1)), [Wait.from_dict(w) for w in d.get("waits", [])],
                    dict(d.get("params", {})), int(d.get("sm", 0)), int(d.get("est_bytes", 0)),
                    int(d.get("est_flops", 0)), str(d.get("label", "")))


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU as data. ``hbm_gbps`` is the practical streaming read bandwidth used for rooflines."""
    name: str
    sm_count: int
    smem_per_block: int      # opt-in dynamic shared memory per block, bytes
    hbm_gbps: float
    l2_bytes: int
    arch: str                # nvcc gencode target, e.g. "sm_90a"
    max_threads_per_block: int = 1024

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "GpuTarget":
        fields = {f.name for f in dataclasses.fields(GpuTarget)}
        unknown = set(d) - fields
        if unknown:
            raise IRError(f"GpuTarget: unknown field(s) {sorted(unknown)}")
        return GpuTarget(**d)

    @staticmethod
    def from_device(index: int = 0) -> "GpuTarget":
        """Read the live GPU (torch.cuda). Bandwidth comes from the closest known target of the same name."""
        import torch
        if not torch.cuda.is_available():
            raise IRError("GpuTarget.from_device: no CUDA device is available")
        p = torch.cuda.get_device_properties(index)
        major, minor = p.major, p.minor
        arch = f"sm_{major}{minor}" + ("a" if (major, minor) in ((9, 0), (10, 0)) else "")
        known = guess_target_name(p.name)
        bw = TARGETS[known].hbm_gbps if known else 1000.0
        smem = getattr(p, "shared_memory_per_block_optin", 0) or (TARGETS[known].smem_per_block if known else 49152)
        l2 = getattr(p, "L2_cache_size", 0) or (TARGETS[known].l2_bytes if known else 0)
        return GpuTarget(known or p.name, p.multi_processor_count, int(smem), float(bw), int(l2), arch)


# hbm_gbps: practical streaming-read bandwidth (H100: measured 3.05 TB/s on 2026-11-22, see DESIGN.md;
# others: ~90% of the datasheet number until measured).
TARGETS: dict[str, GpuTarget] = {t.name: t for t in [
    GpuTarget("h100", 132, 232448, 3050.0, 50 * 2**20, "sm_90a"),
    GpuTarget("h200", 132, 232448, 4300.0, 60 * 2**20, "sm_90a"),
    GpuTarget("a100", 108, 166912, 1800.0, 40 * 2**20, "sm_80"),
    GpuTarget("l4", 58, 101376, 270.0, 48 * 2**20, "sm_89"),
    GpuTarget("rtx4090", 128, 101376, 900.0, 72 * 2**20, "sm_89"),
    GpuTarget("rtx5090", 170, 101376, 1600.0, 96 * 2**20, "sm_120"),
    GpuTarget("b200", 148, 232448, 7200.0, 126 * 2**20, "sm_100a"),
]}


def guess_target_name(device_name: str) -> str | None:
    n = device_name.lower().replace(" ", "")
    for key, pats in (("h200", ["h200"]), ("h100", ["h100"]), ("a100", ["a100"]), ("l4", ["l4"]),
                      ("rtx4090", ["4090"]), ("rtx5090", ["5090"]), ("b200", ["b200"])):
        if any(p in n for p in pats):
            return key
    return None


def get_target(name: str) -> GpuTarget:
    key = name.lower()
    if key in ("auto", "device", "live"):
        return GpuTarget.from_device()
    if key not in TARGETS:
        raise IRError(f"unknown GPU '{name}'; known: {', '.join(sorted(TARGETS))} (or 'auto' for the live device)")
    return TARGETS[key]


class ScheduleConfig:
    """The search surface: one value per knob of ``flywheel.prior.KNOBS`` (the single source of knobs).

    ``ScheduleConfig.from_dict`` rejects unknown keys and bad values with an IRError naming the field;
    ``check_target`` rejects values a GPU cannot run (threads, SM count).
    """

    def __init__(self, **values: Any):
        from flywheel.prior import KNOB_BY_NAME, defaults, ring_window_too_big
        merged = defaults()
        errors = []
        for k, v in values.items():
            if k not in KNOB_BY_NAME:
                errors.append(f"unknown config key '{k}' (known: {', '.join(sorted(KNOB_BY_NAME))})")
                continue
            err = KNOB_BY_NAME[k].check(v)
            if err:
                errors.append(err)
            merged[k] = v
        if not errors and ring_window_too_big(merged):
            errors.append(f"ring_window: {merged['ring_window']} copies in flight must be below ring_stages "
                          f"{merged['ring_stages']} (a window of every stage is no window)")
        if errors:
            raise IRError("invalid ScheduleConfig: " + "; ".join(errors))
        self.__dict__["_values"] = merged

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ScheduleConfig is immutable; use .replace(**changes)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScheduleConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"ScheduleConfig({self.to_dict()})"

    def replace(self, **changes: Any) -> "ScheduleConfig":
        return ScheduleConfig(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        return dict(self.__dict__["_values"])

    @staticmethod
    def from_dict(d: Any) -> "ScheduleConfig":
        if not isinstance(d, dict):
            raise IRError(f"ScheduleConfig must be a JSON object, got {type(d).__name__}")
        return ScheduleConfig(**d)

    @staticmethod
    def from_json(text: str) -> "ScheduleConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise IRError(f"config is not valid JSON: {e}") from None
        return ScheduleConfig.from_dict(d)

    def check_target(self, target: GpuTarget) -> list[str]:
        """Errors (each naming the field) for values this GPU cannot run."""
        errs = []
        if self.threads_per_block > target.max_threads_per_block:
            errs.append(f"threads_per_block: {self.threads_per_block} exceeds the {target.name} limit "
                        f"{target.max_threads_per_block}")
        if self.num_sms > target.sm_count:
            errs.append(f"num_sms: {self.num_sms} exceeds the {target.name}'s {target.sm_count} SMs")
        return errs

    def sms_for(self, target: GpuTarget) -> int:
        return self.num_sms or target.sm_count


@dataclasses.dataclass
class MegakernelProgram:
    meta: dict
    target: GpuTarget
    buffers: list[Buffer]
    counters: list[Counter]
    tasks: list[Task]
    queues: list[list[int]]          # queues[sm] = task ids in run order
    config: dict                     # the ScheduleConfig (as a dict) that produced it

    # -- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "meta": self.meta, "target": self.target.to_dict(),
                "config": self.config, "buffers": [b.to_dict() for b in self.buffers],
                "counters": [c.to_dict() for c in self.counters], "tasks": [t.to_dict() for t in self.tasks],
                "queues": [list(q) for q in self.queues]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: Any) -> "MegakernelProgram":
        """Parse a program dict. Raises IRError (naming the field) on anything malformed."""
        if not isinstance(d, dict):
            raise IRError(f"program must be a JSON object, got {type(d).__name__}")
        ver = str(d.get("format_version", ""))
        if ver.split(".")[0] != FORMAT_VERSION.split(".")[0]:
            raise IRError(f"program format_version '{ver}' is not compatible with {FORMAT_VERSION} (major differs)")
        try:
            return MegakernelProgram(
                meta=dict(d.get("meta", {})), target=GpuTarget.from_dict(d["target"]),
                buffers=[Buffer.from_dict(b) for b in d["buffers"]],
                counters=[Counter.from_dict(c) for c in d["counters"]],
                tasks=[Task.from_dict(t) for t in d["tasks"]],
                queues=[[int(x) for x in q] for q in d["queues"]], config=dict(d.get("config", {})))
        except IRError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise IRError(f"malformed program: {type(e).__name__}: {e}") from None

    @staticmethod
    def from_json(text: str) -> "MegakernelProgram":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise IRError(f"program is not valid JSON: {e}") from None
        return MegakernelProgram.from_dict(d)

    # -- queries -----------------------------------------------------------------------------------------------
    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def weight_bytes(self) -> int:
        """Bytes of distinct weight storage (tied embeddings counted once)."""
        seen, total = set(), 0
        for b in self.buffers:
            if b.kind == BufferKind.WEIGHT and b.storage_key not in seen:
                seen.add(b.storage_key)
                total += b.nbytes
        return total

    def stats(self) -> dict:
        ops: dict[str, int] = {}
        for t in self.tasks:
            ops[t.op] = ops.get(t.op, 0) + 1
        loads = [sum(self.tasks[i].est_bytes for i in q) for q in self.queues]
        return {"tasks": len(self.tasks), "counters": len(self.counters), "buffers": len(self.buffers),
                "sms": len(self.queues), "ops": ops, "weight_bytes": self.weight_bytes,
                "max_sm_bytes": max(loads) if loads else 0,
                "mean_sm_bytes": (sum(loads) / len(loads)) if loads else 0.0}


def topological_order(program: MegakernelProgram) -> list[int] | None:
    """Task ids in an order consistent with counter waits and queue order; None if there is a cycle."""
    from .validate import happens_before_edges
    n = len(program.tasks)
    edges = happens_before_edges(program)
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
    order, _ = kahn_order(succ)
    return order if len(order) == n else None


def step_name(base: str, step: int) -> str:
    """The name of decode step ``step``'s copy of a per-step buffer or counter in a multi-step launch
    (steps_per_launch): ``base`` for step 0, ``base@step`` after it ('pos@2', 'logits@1', 'x0@3')."""
    return f"{base}@{step}" if step else base


def name_step(name: str, base: str) -> int | None:
    """The step whose copy of ``base`` is called ``name`` (step_name's inverse), None if it is not one."""
    if name == base:
        return 0
    tail = name[len(base) + 1:] if name.startswith(base + "@") else ""
    return int(tail) if tail.isdigit() and int(tail) > 0 else None


def task_step(task: "Task") -> int:
    """The decode step of a multi-step launch a task belongs to (steps_per_launch: schedule/lower.py labels step
    s >= 1's tasks 's<s>.'); 0 for step 0 and for unlabelled tasks."""
    lab = task.label or ""
    if lab.startswith("s") and "." in lab and lab[1:lab.index(".")].isdigit():
        return int(lab[1:lab.index(".")])
    return 0


def kahn_order(succ: list[list[int]]) -> tuple[list[int], list[int]]:
    """Kahn's topological sort of a graph given as successor lists: (order, remaining in-degrees).
    ``len(order) < len(succ)`` means a cycle; the nodes with in-degree > 0 are on or behind it."""
    indeg = [0] * len(succ)
    for vs in succ:
        for v in vs:
            indeg[v] += 1
    order, ready = [], [v for v in range(len(succ)) if indeg[v] == 0]
    while ready:
        v = ready.pop()
        order.append(v)
        for u in succ[v]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return order, indeg


def validate(program: Any):
    """Prove the program deadlock- and race-free. Never raises; returns a ValidationResult."""
    from .validate import validate as _validate
    return _validate(program)
