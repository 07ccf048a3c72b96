"""The program validator: the one gate between a (possibly agent-written) schedule and the GPU.

``validate(program_or_dict) -> ValidationResult`` never raises. It proves, for the contract in ``schedule/ir.py``
(counters zeroed per step; a producer increments its ``out_counter`` once after all its writes; ``Wait(c, t)``
blocks until ``c >= t``; a block runs its SM queue in order; all blocks are co-resident):

1. *Referential integrity*: ids equal list positions, buffer/counter ids in range, every task in exactly one queue,
   ``task.sm`` equal to that queue's index, no more queues than the target has SMs.
2. *Opcode and ABI*: known opcode, input/output arity for the flag params, required int/float params present,
   integral / finite and int32-sized, at most ``MAX_WAITS`` waits and ``MAX_BUFS`` buffers, outputs never
   WEIGHT/CONST/IO_INPUT, every access range (``schedule.ops.accesses``) inside its buffer, shapes the op relies on.
3. *Counters*: every wait's threshold equals the number of producers of its counter (above: never satisfied =
   deadlock; below: the waiter may run before some producer = no ordering); no wait on an unsignalled counter or on
   the task's own ``out_counter``.
4. *Deadlock freedom*: the happens-before (HB) graph -- producer -> counter -> waiter (for waits whose threshold
   covers every producer), plus consecutive tasks of one queue -- is acyclic; a wait on work queued later on the same
   SM is reported as a queue-order error. With (3) and co-residency this is exactly "no execution hangs".
5. *Race freedom* (ACTIVATION / IO_OUTPUT / KV_CACHE): two accesses of different tasks to overlapping elements, one
   a write, are HB-ordered (transitive closure); each element read is written earlier in the step by an
   HB-predecessor (scratch is NaN-poisoned; a KV read needs this step's append); every IO_OUTPUT element is written;
   no KV_CACHE element is written by two tasks in one step (the cache outlives the step: one write would be lost).
   A multi-step launch (IO_INPUT 'pos@s': step s's position) keeps these KV rules per step, and a KV read of step s
   must be ordered after every KV append of the steps before it (it reads their rows as its history).
   The members of a claim group (GEMV_SILU_MUL dyn_rows > 0: one computation whose rows the members split at run
   time through a ticket counter) may write their common range unordered among themselves, and only that: they
   must be identical but for dyn_index, cover indices 0..dyn_tasks-1, and no task may wait on or signal the claim.
   Races are judged with under-counted waits taken as ordering all producers (optimistic), so each one is certain.
6. *Data-flagged activations* (``Buffer.flagged``, ``Wait.data``; knob flag_hops): a flagged buffer is an fp32
   ACTIVATION accessed only in the (opcode, slot) pairs of ``vm.abi.FLAG_SLOTS``; each of its elements is written
   at most once per launch (its words carry the launch's tag, so a second write could not be told from the first).
   A data wait is no happens-before edge for memory: (5) is proved on the HB graph without those edges, except that
   a read of a flagged element is ordered after its writer by the reader's own polling -- which needs the writer
   to be an ancestor of the reader in the full dependency graph (4), or the poll could wait forever.

Speed (11k-task llama-3.2-1b: ~1.2 s on one idle core): a counter is a graph node (P producers + W waiters = P + W edges, not
P*W); ancestor sets are Python-int bitsets indexed by topological rank, built in topological order and freed once
their successors have used them; each access is tested against OR-ed masks of the overlapping accesses of its
buffer (ranges grouped, then swept in sorted order), restricted to tasks earlier in the order.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from schedule.ir import Buffer, BufferKind, Counter, DType, GpuTarget, IRError, MegakernelProgram, Task, kahn_order
from schedule.ops import is_dyn, kv_ahead_issuer_ok
from schedule.validate_races import RaceChecks
from schedule.validate_task import TaskChecks, _is_int

MAX_PER_KIND = 25   # errors kept per kind (the rest are counted)


@dataclasses.dataclass
class ValidationResult:
    ok: bool
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    stats: dict = dataclasses.field(default_factory=dict)

    def report(self) -> str:
        head = "OK: program is valid" if self.ok else f"REJECTED: {len(self.errors)} error(s)"
        lines = [head]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        if self.stats:
            lines.append("  stats: " + ", ".join(f"{k}={v}" for k, v in self.stats.items()))
        return "\n".join(lines)


def _coerce(program: Any) -> tuple[MegakernelProgram | None, str | None]:
    if isinstance(program, MegakernelProgram):
        return program, None
    if not isinstance(program, (str, bytes, dict)):
        return None, f"expected a MegakernelProgram, its dict or JSON text, got {type(program).__name__}"
    try:
        parse = MegakernelProgram.from_dict if isinstance(program, dict) else MegakernelProgram.from_json
        return parse(program), None
    except IRError as e:
        return None, f"malformed program: {e}"


def validate(program: Any) -> ValidationResult:
    """Validate a program (MegakernelProgram, dict or JSON text). Never raises."""
    t0 = time.perf_counter()
    try:
        prog, err = _coerce(program)
        if err:
            res = ValidationResult(False, [err])
        else:
            v = _Validator(prog)
            v.run()
            res = ValidationResult(not v.errors, v.errors, v.warnings, v.stats)
    except Exception as e:  # noqa: BLE001 -- the contract is "never raises"; anything unexpected rejects
        res = ValidationResult(False, [f"malformed program (validator could not analyse it): "
                                       f"{type(e).__name__}: {e}"])
    res.stats["validate_s"] = round(time.perf_counter() - t0, 4)
    return res


def happens_before_edges(program: MegakernelProgram) -> list[tuple[int, int]]:
    """Task-index pairs (a, b): a happens before b directly -- every producer of a counter -> each task waiting on
    it, and consecutive tasks of one SM queue. Out-of-range references are skipped. Sorted, without duplicates."""
    n = len(program.tasks)
    producers: dict[int, list[int]] = {}
    for i, t in enumerate(program.tasks):
        if _is_int(t.out_counter) and t.out_counter >= 0:
            producers.setdefault(t.out_counter, []).append(i)
    edges = set()
    for j, t in enumerate(program.tasks):
        for w in t.waits:
            for p in producers.get(w.counter, ()):
                if p != j:
                    edges.add((p, j))
    for q in program.queues:
        for a, b in zip(q, q[1:]):
            if _is_int(a) and _is_int(b) and 0 <= a < n and 0 <= b < n and a != b:
                edges.add((a, b))
    return sorted(edges)




class _Validator(TaskChecks, RaceChecks):
    def __init__(self, p: MegakernelProgram):
        self.p = p
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.stats: dict = {}
        self._kind_count: dict[str, int] = {}
        self.acc: dict[int, list] = {}

    # -- reporting -------------------------------------------------------------------------------------------
    def err(self, kind: str, msg: str) -> None:
        self._kind_count[kind] = c = self._kind_count.get(kind, 0) + 1
        if c <= MAX_PER_KIND:
            self.errors.append(msg)

    def _flush_counts(self) -> None:
        for kind, c in self._kind_count.items():
            if c > MAX_PER_KIND:
                self.errors.append(f"... and {c - MAX_PER_KIND} more '{kind}' error(s)")

    def T(self, i: int) -> str:
        t = self.p.tasks[i]
        if not isinstance(t, Task):
            return f"task {i}"
        return f"task {i} ({t.op}{' ' + t.label if isinstance(t.label, str) and t.label else ''})"

    def B(self, b: int) -> str:
        if self.kinds.get(b) is None:
            return f"buffer {b}"
        return f"buffer {b} '{self.p.buffers[b].name}' ({self.kinds[b].value})"

    def C(self, c: int) -> str:
        name = self.p.counters[c].name if 0 <= c < len(self.p.counters) else ""
        return f"counter {c}" + (f" '{name}'" if name else "")

    # -- driver ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        p = self.p
        for field, typ in (("buffers", list), ("counters", list), ("tasks", list), ("queues", list)):
            if not isinstance(getattr(p, field, None), typ):
                self.err("structure", f"program.{field} must be a list")
                self._flush_counts()
                return
        self._check_target()
        self._check_buffers()
        self._check_counters()
        self.task_ok = [self._check_task(i) for i in range(len(p.tasks))]
        queues_ok = self._check_queues()
        self.stats.update(tasks=len(p.tasks), buffers=len(p.buffers), counters=len(p.counters), sms=len(p.queues),
                          waits=sum(len(t.waits) for t in p.tasks if isinstance(t, Task) and isinstance(t.waits, list)))
        if all(self.task_ok) and queues_ok:
            self._check_thresholds()
            self._check_flag_slots()
            self._check_claim_groups()
            self._check_kv_ahead()
            if self._check_graph():
                # Races are judged with every wait on a signalled counter ordering all its producers first --
                # optimistic for an under-counted wait (already an error), so each race reported is certain.
                optimistic = [{w.counter for w in t.waits if self.producers[w.counter]} for t in p.tasks]
                stuck = None
                if optimistic != self.binding:
                    self.order, stuck = self._build(optimistic)
                if stuck:
                    self.warnings.append("race analysis skipped: the under-counted waits would form a cycle")
                else:
                    self._check_races()
        else:
            self.warnings.append("dependency / race analysis skipped: fix the integrity errors first")
        if self._kind_count:
            self.stats["error_kinds"] = dict(self._kind_count)
        self._flush_counts()

    # -- 1. integrity ----------------------------------------------------------------------------------------
    def _check_target(self) -> None:
        t = self.p.target
        self.sm_count = t.sm_count if isinstance(t, GpuTarget) and _is_int(t.sm_count) and t.sm_count >= 1 else None
        if self.sm_count is None:
            self.err("target", f"target must be a GpuTarget with sm_count >= 1, got {t!r}"[:200])

    def _check_buffers(self) -> None:
        self.kinds: dict[int, BufferKind | None] = {}
        self.numel: dict[int, int | None] = {}
        for i, b in enumerate(self.p.buffers):
            self.kinds[i], self.numel[i] = None, None
            if not isinstance(b, Buffer):
                self.err("buffer", f"buffer {i}: not a Buffer ({type(b).__name__})")
                continue
            if b.id != i:
                self.err("buffer", f"buffer {i} '{b.name}': id {b.id!r} != its position {i}")
            try:
                kind = BufferKind(b.kind)
                DType(b.dtype)
            except (ValueError, TypeError):
                self.err("buffer", f"buffer {i} '{b.name}': bad kind {b.kind!r} or dtype {b.dtype!r}")
                continue
            self.kinds[i] = kind
            shape = b.shape
            if not isinstance(shape, (tuple, list)) or not all(_is_int(s) and s >= 1 for s in shape):
                self.err("buffer", f"{self.B(i)}: shape {shape!r} must be a list of integers >= 1")
                continue
            self.numel[i] = math.prod(shape)
            if kind == BufferKind.CONST and (not isinstance(b.data, list) or len(b.data) != self.numel[i]):
                self.err("buffer", f"{self.B(i)}: CONST data has {len(b.data) if isinstance(b.data, list) else None}"
                                   f" values, shape {tuple(shape)} needs {self.numel[i]}")
            if kind == BufferKind.WEIGHT and (not isinstance(b.source, str) or not b.source):
                self.err("buffer", f"{self.B(i)}: WEIGHT buffer has no source (state-dict key)")
            if b.flagged and not (kind == BufferKind.ACTIVATION and DType(b.dtype) == DType.F32):
                self.err("flag", f"{self.B(i)}: only fp32 ACTIVATION buffers can be data-flagged")
            cols = getattr(b, "cols", None)
            if cols is not None and not (kind == BufferKind.WEIGHT and len(shape) == 2 and isinstance(cols, tuple)
                                         and len(cols) == 2 and all(_is_int(c) for c in cols) and cols[0] >= 0
                                         and cols[1] == shape[1]):
                self.err("buffer", f"{self.B(i)}: cols {cols!r} must be (first column >= 0, count == shape[1]) "
                                   f"of a 2-D WEIGHT buffer")

    def _check_counters(self) -> None:
        for i, c in enumerate(self.p.counters):
            if not isinstance(c, Counter) or c.id != i:
                self.err("counter", f"counter {i}: not a Counter whose id equals its position {i} ({c!r})"[:200])

    def _check_queues(self) -> bool:
        p, n, ok = self.p, len(self.p.tasks), True
        if self.sm_count is not None and len(p.queues) > self.sm_count:
            self.err("queues", f"{len(p.queues)} queues but target {p.target.name} has {self.sm_count} SMs: "
                               f"blocks would not all be co-resident")
            ok = False
        self.pos: dict[int, tuple[int, int]] = {}
        for sm, q in enumerate(p.queues):
            if not isinstance(q, list):
                self.err("queues", f"queue {sm} is not a list")
                ok = False
                continue
            for k, tid in enumerate(q):
                if not _is_int(tid) or not 0 <= tid < n:
                    self.err("queues", f"queue {sm} position {k}: task id {tid!r} out of range [0, {n})")
                    ok = False
                elif tid in self.pos:
                    self.err("queues", f"{self.T(tid)} is queued twice (SM {self.pos[tid][0]} and SM {sm})")
                    ok = False
                else:
                    self.pos[tid] = (sm, k)
                    if isinstance(p.tasks[tid], Task) and p.tasks[tid].sm != sm:
                        self.err("queues", f"{self.T(tid)}: task.sm = {p.tasks[tid].sm!r} but it is queued on SM {sm}")
                        ok = False
        for i in range(n):
            if i not in self.pos and isinstance(p.tasks[i], Task):
                self.err("queues", f"{self.T(i)} is in no queue: it never runs")
                ok = False
        return ok

    # -- 3. counters -----------------------------------------------------------------------------------------
    def _check_thresholds(self) -> None:
        p = self.p
        self.producers: list[list[int]] = [[] for _ in p.counters]
        self.waiters: list[set[int]] = [set() for _ in p.counters]
        # binding[j]: counters whose wait orders *every* producer before j (threshold >= producers > 0); an
        # under-counted wait orders no particular producer, so it adds no happens-before edge.
        self.binding: list[set[int]] = [set() for _ in p.tasks]
        for i, t in enumerate(p.tasks):
            if t.out_counter >= 0:
                self.producers[t.out_counter].append(i)
        self.data_waits: set[tuple[int, int]] = set()   # (task, counter): a Wait.data, no HB edge for memory
        for j, t in enumerate(p.tasks):
            for w in t.waits:
                c, P = w.counter, len(self.producers[w.counter])
                self.waiters[c].add(j)
                if getattr(w, "data", False):
                    self.data_waits.add((j, c))
                if 0 < P <= w.threshold:
                    self.binding[j].add(c)
                if t.out_counter == c:
                    self.err("self-wait", f"{self.T(j)} waits on {self.C(c)}, its own out_counter"
                                          + (": deadlock" if w.threshold >= P else " (it cannot order itself)"))
                elif P == 0:
                    self.err("unsignalled", f"{self.T(j)} waits on {self.C(c)} that no task signals: deadlock")
                elif w.threshold > P:
                    self.err("threshold-high", f"{self.T(j)} waits for {self.C(c)} >= {w.threshold} but it has only "
                                               f"{P} producer(s): never satisfied (deadlock)")
                elif w.threshold < P:
                    self.err("threshold-low", f"{self.T(j)}: under-counted wait: {self.C(c)} >= {w.threshold} but it "
                                              f"has {P} producers: ordering not guaranteed")
        claims = {int(t.params["dyn_claim"]) for t in p.tasks if is_dyn(t.params)}
        for c in range(len(p.counters)):
            if not self.producers[c] and not self.waiters[c] and c not in claims:
                self.warnings.append(f"{self.C(c)} is never signalled nor waited on")

    def _check_kv_ahead(self) -> None:
        """early_kv 2 (an attention task's KV history issued by the task before it in its queue): that task must
        exist and be a weight tile that issues no cp.async of its own (schedule.ops.kv_ahead_issuer_ok), else the
        op would read stages nobody filled (the loader refuses such a program too)."""
        p = self.p
        for q in p.queues:
            for j, i in enumerate(q):
                t = p.tasks[i]
                if int(t.params.get("early_kv", 0)) != 2:
                    continue
                if j == 0:
                    self.err("kv-ahead", f"{self.T(i)} has early_kv 2 but is the first task of its queue: no task "
                                         f"before it issues its KV history")
                elif not kv_ahead_issuer_ok(p.tasks[q[j - 1]]):
                    self.err("kv-ahead", f"{self.T(i)} has early_kv 2 but the task before it, {self.T(q[j - 1])}, "
                                         f"cannot issue its KV history (only a QKV_ROPE, GEMV without merged "
                                         f"attention partials, GEMV_SILU_MUL or GEMV_SILU_MUL_DOWN task can)")

    def _check_claim_groups(self) -> None:
        """Claim groups (GEMV_SILU_MUL dyn_rows > 0, vm/abi.py): the members sharing a claim counter are one
        computation split at run time, so they must be identical but for dyn_index (same inputs, outputs, waits,
        out_counter, params), their indices exactly 0..dyn_tasks-1, and the claim counter a pure ticket: no task
        waits on it or signals it. The race check then lets the members' writes of their common range overlap."""
        p = self.p
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(p.tasks):
            if is_dyn(t.params):
                groups.setdefault(int(t.params["dyn_claim"]), []).append(i)
        self.claim_group: dict[int, int] = {}   # task -> its claim counter
        for c, members in groups.items():
            t0 = p.tasks[members[0]]
            sig = lambda t: (t.op, list(t.inputs), list(t.outputs), [(w.counter, w.threshold) for w in t.waits],  # noqa: E731
                             t.out_counter, {k: v for k, v in t.params.items() if k != "dyn_index"})
            ok = True
            for i in members[1:]:
                if sig(p.tasks[i]) != sig(t0):
                    self.err("claim-group", f"{self.T(i)} and {self.T(members[0])} share claim {self.C(c)} but differ "
                                            f"in more than dyn_index (op, buffers, waits, out_counter or params): "
                                            f"the members of a claim group must be one computation")
                    ok = False
            idx = sorted(int(p.tasks[i].params["dyn_index"]) for i in members)
            n = int(t0.params["dyn_tasks"])
            if idx != list(range(n)):
                self.err("claim-group", f"claim {self.C(c)}: members have dyn_index {idx[:8]}{'...' if len(idx) > 8 else ''}"
                                        f", expected each of 0..{n - 1} once (dyn_tasks {n}): chunks would be lost or "
                                        f"computed twice")
                ok = False
            if self.producers[c] or self.waiters[c]:
                who = (self.producers[c] or sorted(self.waiters[c]))[0]
                self.err("claim-group", f"claim {self.C(c)} of {self.T(members[0])}'s group is also "
                                        f"{'signalled' if self.producers[c] else 'waited on'} by {self.T(who)}: a "
                                        f"claim counter only hands out tickets")
                ok = False
            if ok:
                for i in members:
                    self.claim_group[i] = c

    # -- 4. graph --------------------------------------------------------------------------------------------
    def _check_graph(self) -> bool:
        p, n, C = self.p, len(self.p.tasks), len(self.p.counters)
        # queue order must be a linear extension: no wait on a producer queued later on the same SM
        last: list[dict[int, tuple[int, int]]] = [{} for _ in range(C)]
        for i in range(n):
            c = p.tasks[i].out_counter
            if c >= 0:
                sm, k = self.pos[i]
                if k >= last[c].get(sm, (-1, -1))[0]:
                    last[c][sm] = (k, i)
        for j in range(n):
            sm, k = self.pos[j]
            for c in self.binding[j]:
                kp, prod = last[c].get(sm, (-1, -1))
                if kp > k:
                    self.err("queue-order", f"SM {sm} queue: {self.T(j)} at position {k} waits on {self.C(c)},"
                                            f" produced by {self.T(prod)} queued later at position {kp} on the same "
                                            f"SM: deadlock (queue is not a linear extension)")
        order, stuck = self._build(self.binding)
        self.stats["hb_edges"] = sum(len(x) for x in self.succ)
        if stuck:
            self._report_cycle(stuck, n)
            return False
        self.order = order
        depth, dbytes = [0] * (n + C), [0] * (n + C)   # critical path in tasks and in est_bytes
        for v in order:
            d = max((depth[u] for u in self.preds[v]), default=0)
            db = max((dbytes[u] for u in self.preds[v]), default=0)
            if v < n:
                eb = p.tasks[v].est_bytes
                d, db = d + 1, db + (eb if _is_int(eb) else 0)
            depth[v], dbytes[v] = d, db
        self.stats.update(critical_path_tasks=max(depth[:n], default=0),
                          critical_path_bytes=max(dbytes[:n], default=0),
                          max_queue_len=max((len(q) for q in p.queues), default=0))
        return True

    def _build(self, waits: list[set[int]]) -> tuple[list[int], set[int]]:
        """The HB node graph (tasks 0..n-1, counters n..n+C-1) with wait edges from ``waits[j]``; returns a
        topological order and the nodes left on or behind a cycle."""
        p, n, C = self.p, len(self.p.tasks), len(self.p.counters)
        succ: list[list[int]] = [[] for _ in range(n + C)]
        preds: list[list[int]] = [[] for _ in range(n + C)]
        for q in p.queues:
            for a, b in zip(q, q[1:]):
                succ[a].append(b)
                preds[b].append(a)
        for i in range(n):
            if p.tasks[i].out_counter >= 0:
                succ[i].append(n + p.tasks[i].out_counter)
                preds[n + p.tasks[i].out_counter].append(i)
            for c in waits[i]:
                succ[n + c].append(i)
                preds[i].append(n + c)
        order, indeg = kahn_order(succ)
        self.succ, self.preds = succ, preds
        return order, ({v for v in range(n + C) if indeg[v] > 0} if len(order) < n + C else set())

    def _report_cycle(self, stuck: set[int], n: int) -> None:
        start = min(v for v in stuck if v < n) if any(v < n for v in stuck) else min(stuck)
        seen: dict[int, int] = {}
        path, v = [], start
        while v not in seen:  # every stuck node has a stuck predecessor: walk back until a repeat
            seen[v] = len(path)
            path.append(v)
            v = next(u for u in self.preds[v] if u in stuck)
        cyc = list(reversed(path[seen[v]:]))
        parts = []
        for x in cyc:
            parts.append(self.T(x) + f" [SM {self.pos[x][0]}]" if x < n else self.C(x - n))
        first = next((x for x in cyc if x < n), None)
        self.err("cycle", f"dependency cycle (deadlock) through {self.T(first) if first is not None else 'counters'}: "
                          + " -> ".join(parts + [parts[0]]) + f"; {sum(1 for x in stuck if x < n)} task(s) can never run")
