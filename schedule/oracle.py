"""An independent dynamic oracle for deadlocks and data races (issue 7). It shares no code with
``schedule/validate.py``: it never builds a static dependency graph; it *runs* the program's synchronisation.

Model (the contract of ``schedule/ir.py``, executed literally):
  * every SM block runs its queue in order; a queue head may run once ``counter[c] >= t`` for each of its waits;
    at most ``target.sm_count`` blocks are resident, later queues start when a resident one finishes;
  * a task's body (its ``schedule.ops.accesses``) happens atomically at its turn, then it increments ``out_counter``.
  * happens-before is tracked with vector clocks (one component per SM). A release (increment) snapshots the
    producer's clock; an acquire of ``Wait(c, t)`` joins only the clocks of the **first t increments** of c -- the
    weakest synchronisation a real GPU can give (the waiter may read the counter the instant it reaches t), so a
    producer outside that prefix is *not* ordered before the waiter even if it happened to run earlier.
  * every access is compared with every earlier access to an overlapping range of the same buffer (ACTIVATION,
    IO_OUTPUT, KV_CACHE): a write/write or write/read pair of different tasks whose earlier epoch is not covered by
    the later task's clock is a race. Reads of elements not yet written in this step (NaN-poisoned ACTIVATION /
    IO_OUTPUT scratch; a KV_CACHE slice whose append for this step has not run) and IO_OUTPUT elements never
    written are reported as ``uninit``.
  * no queue head runnable with work left = deadlock.
  * a KV_CACHE element written by two tasks in one step is ``clobber``: the cache outlives the step, and the next
    step can read only one of the two values (e.g. two layers aliased onto one cache), ordered or not.

Exploration: counters only grow, so whether a run deadlocks, and which tasks run, is the same in every interleaving.
The HB relation of a run differs between interleavings only through *which* increments form the first-t prefix of a
wait; when every wait's threshold equals its counter's final count the HB relation -- hence the race verdict -- is
identical in all interleavings and one run is complete. Otherwise (a wait that a subset of producers satisfies) the
oracle enumerates every interleaving for programs of at most ``exhaustive_tasks`` tasks, and for larger ones runs
random orders plus, for each producer of an under-counted counter, an order that delays that producer as long as
the program allows (so it misses the prefix), and random delay sets.

Besides deadlock / race / uninit, the oracle reports what makes a program impossible to run as written:
``malformed`` (dangling ids, unknown opcode, arity, a task queued twice or never), ``oob`` (an access outside its
buffer), ``readonly`` (a write to WEIGHT / CONST / IO_INPUT) and ``unencodable`` (over the ABI caps).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from schedule.ir import BufferKind, MegakernelProgram
from schedule.ops import accesses
from vm.abi import MAX_BUFS, MAX_WAITS, OPCODES

TRACKED = (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT, BufferKind.KV_CACHE)
READ_ONLY = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT)


@dataclasses.dataclass
class OracleResult:
    ok: bool
    findings: dict[str, list[str]]     # category -> messages (deadlock, race, uninit, malformed, oob, ...)
    runs: int = 0
    exhaustive: bool = False

    @property
    def categories(self) -> list[str]:
        return sorted(k for k, v in self.findings.items() if v)

    def summary(self) -> str:
        if self.ok:
            return f"oracle: no deadlock or race in {self.runs} run(s){' (exhaustive)' if self.exhaustive else ''}"
        return "oracle: " + "; ".join(f"{k}: {v[0]}" for k, v in sorted(self.findings.items()) if v)


class _Static:
    """What the simulation needs, re-derived from the program fields, plus the 'cannot run as written' findings."""

    def __init__(self, p: MegakernelProgram):
        self.p, self.f = p, {}
        nb, nc, n = len(p.buffers), len(p.counters), len(p.tasks)
        self.acc: list[list] = []
        for i, t in enumerate(p.tasks):
            self.acc.append([])
            spec = OPCODES.get(t.op)
            if spec is None:
                self.add("malformed", f"task {i}: unknown opcode {t.op!r}")
                continue
            try:
                n_in = len(spec.input_slots(t.params))
            except (TypeError, ValueError):
                self.add("malformed", f"task {i}: bad flag params")
                continue
            n_out = len(spec.output_slots(t.params))
            if len(t.inputs) != n_in or len(t.outputs) != n_out:
                self.add("malformed", f"task {i} {t.op}: {len(t.inputs)}/{len(t.outputs)} buffers, wants "
                                      f"{n_in}/{n_out}")
                continue
            if any(not isinstance(b, int) or not 0 <= b < nb for b in t.inputs + t.outputs):
                self.add("malformed", f"task {i} {t.op}: dangling buffer id")
                continue
            ints = [t.params.get(k, 0) for k in spec.iparams]         # what the loader packs into int32 slots
            if len(t.waits) > MAX_WAITS or len(t.inputs) + len(t.outputs) > MAX_BUFS or not all(
                    isinstance(v, int) and -2**31 <= v < 2**31 for v in ints):
                self.add("unencodable", f"task {i} {t.op}: over the ABI caps")
            if any(not 0 <= w.counter < nc for w in t.waits) or not -1 <= t.out_counter < nc:
                self.add("malformed", f"task {i} {t.op}: dangling counter id")
                continue
            try:
                acc = accesses(t, lambda b: p.buffers[b].numel)
            except Exception as e:  # noqa: BLE001 -- the program cannot be run as written
                self.add("malformed", f"task {i} {t.op}: {type(e).__name__}: {e}")
                continue
            for a in acc:
                kind = p.buffers[a.buffer].kind
                if a.lo < 0 or a.hi > p.buffers[a.buffer].numel or a.lo > a.hi:   # empty ranges are harmless
                    self.add("oob", f"task {i} {t.op}: {a.slot} [{a.lo}, {a.hi}) outside buffer {a.buffer} "
                                    f"({p.buffers[a.buffer].numel} elements)")
                if a.write and kind in READ_ONLY:
                    self.add("readonly", f"task {i} {t.op}: writes read-only buffer {a.buffer} ({kind.value})")
            self.acc[-1] = [(a.buffer, max(0, a.lo), min(a.hi, p.buffers[a.buffer].numel), a.write) for a in acc
                            if p.buffers[a.buffer].kind in TRACKED and max(0, a.lo) < min(a.hi, p.buffers[a.buffer].numel)]
        seen: dict[int, int] = {}
        for sm, q in enumerate(p.queues):
            for tid in q:
                if not isinstance(tid, int) or not 0 <= tid < n or tid in seen:
                    self.add("malformed", f"queue {sm}: task {tid} dangling or queued twice")
                else:
                    seen[tid] = sm     # (a task.sm that disagrees with its queue is harmless: queues are what run)
        for i in range(n):
            if i not in seen:
                self.add("malformed", f"task {i}: in no queue")
        self.final = [0] * nc            # increments each counter will get if every task runs
        for t in p.tasks:
            if isinstance(t.out_counter, int) and 0 <= t.out_counter < nc:
                self.final[t.out_counter] += 1

    def add(self, cat: str, msg: str) -> None:
        self.f.setdefault(cat, []).append(msg)


class _Run:
    """One execution in progress (cloneable for exhaustive enumeration)."""

    def __init__(self, s: _Static):
        self.s, p = s, s.p
        nq = len(p.queues)
        self.heads = [0] * nq
        self.vc = [[int(k == sm) for k in range(nq)] for sm in range(nq)]   # epochs start at 1
        self.rel: list[list[tuple]] = [[] for _ in p.counters]     # per counter: clock snapshot per increment
        self.hist: dict[int, list[tuple]] = {}                      # buffer -> (lo, hi, write, sm, epoch, task)
        self.cov: dict[int, bytearray] = {b.id: bytearray(b.numel) for b in p.buffers if b.kind in TRACKED}
        self.started = min(nq, max(1, p.target.sm_count))           # co-resident blocks
        self.done_q = 0
        self.left = sum(len(q) for q in p.queues)
        self.findings: dict[str, list[str]] = {}

    def clone(self) -> "_Run":
        r = _Run.__new__(_Run)
        r.s, r.heads, r.vc = self.s, list(self.heads), [list(v) for v in self.vc]
        r.rel = [list(x) for x in self.rel]
        r.hist = {b: list(h) for b, h in self.hist.items()}
        r.cov = {b: bytearray(c) for b, c in self.cov.items()}
        r.started, r.done_q, r.left, r.findings = self.started, self.done_q, self.left, {}
        return r

    def runnable(self) -> list[int]:
        p, out = self.s.p, []
        for sm in range(self.started):
            q = p.queues[sm]
            if self.heads[sm] < len(q):
                t = p.tasks[q[self.heads[sm]]]
                if all(len(self.rel[w.counter]) >= w.threshold for w in t.waits):
                    out.append(sm)
        return out

    def step(self, sm: int) -> None:
        p = self.s.p
        tid = p.queues[sm][self.heads[sm]]
        t, vc = p.tasks[tid], self.vc[sm]
        for w in t.waits:                                   # acquire: only the first `threshold` increments
            for snap in self.rel[w.counter][:max(0, w.threshold)]:
                for k, x in enumerate(snap):
                    if x > vc[k]:
                        vc[k] = x
        ep = vc[sm]
        for b, alo, ahi, aw in self.s.acc[tid]:
            h = self.hist.setdefault(b, [])
            for lo, hi, wr, osm, oep, otid in h:
                if (wr or aw) and otid != tid and lo < ahi and alo < hi and oep > vc[osm]:
                    kind = "write/write" if wr and aw else "write/read"
                    self.add("race", f"{kind} race on buffer {b} [{max(lo, alo)}, {min(hi, ahi)}): "
                                     f"task {otid} ({p.tasks[otid].op}) and task {tid} ({t.op}) are not ordered")
            h.append((alo, ahi, aw, sm, ep, tid))
            if not aw:
                gap = self.cov[b].find(0, alo, ahi)
                if gap >= 0:
                    self.add("uninit", f"task {tid} ({t.op}) reads element {gap} of buffer {b} before any write "
                                       f"to it in this step (NaN-poisoned scratch, or a KV slot not yet appended)")
        for b, alo, ahi, aw in self.s.acc[tid]:
            if not aw:
                continue
            self.cov[b][alo:ahi] = b"\x01" * (ahi - alo)
            if p.buffers[b].kind == BufferKind.KV_CACHE:    # state that outlives the step
                for lo, hi, wr, _, _, otid in self.hist[b]:
                    if wr and otid != tid and lo < ahi and alo < hi:
                        self.add("clobber", f"persistent buffer {b} [{max(lo, alo)}, {min(hi, ahi)}) written by "
                                            f"task {otid} and task {tid} in one step: a later step reads only one")
        if t.out_counter >= 0:
            self.rel[t.out_counter].append(tuple(vc))       # release
        vc[sm] += 1
        self.heads[sm] += 1
        self.left -= 1
        if self.heads[sm] == len(p.queues[sm]) and self.started < len(p.queues):
            self.started += 1                               # a block finished: the next queue becomes resident

    def finish(self) -> None:
        p = self.s.p
        if self.left:
            stuck = [f"SM {sm} task {p.queues[sm][self.heads[sm]]}" for sm in range(len(p.queues))
                     if self.heads[sm] < len(p.queues[sm])][:4]
            self.add("deadlock", f"{self.left} task(s) never run; blocked heads: {', '.join(stuck)}")
            return
        for b in p.buffers:
            if b.kind == BufferKind.IO_OUTPUT:
                gap = self.cov[b.id].find(0)
                if gap >= 0:
                    self.add("uninit", f"output buffer {b.id} element {gap} is never written")

    def add(self, cat: str, msg: str) -> None:
        lst = self.findings.setdefault(cat, [])
        if len(lst) < 10 and msg not in lst:
            lst.append(msg)


def _run(s: _Static, choose, delayed: frozenset = frozenset()) -> _Run:
    r = _Run(s)
    while r.left:
        ready = r.runnable()
        if not ready:
            break
        pref = [sm for sm in ready if s.p.queues[sm][r.heads[sm]] not in delayed] or ready
        r.step(choose(pref))
    r.finish()
    return r


def check(program: Any, seed: int = 0, runs: int = 8, exhaustive_tasks: int = 8,
          max_interleavings: int = 5000) -> OracleResult:
    """Explore executions of ``program`` (a MegakernelProgram or its dict). Never raises."""
    try:
        p = program if isinstance(program, MegakernelProgram) else MegakernelProgram.from_dict(program)
        s = _Static(p)
    except Exception as e:  # noqa: BLE001
        return OracleResult(False, {"malformed": [f"{type(e).__name__}: {e}"]})
    if s.f.get("malformed"):
        return OracleResult(False, dict(s.f))
    findings: dict[str, list[str]] = {k: list(v) for k, v in s.f.items()}
    rng = random.Random(seed)

    def merge(r: _Run) -> None:
        for k, v in r.findings.items():
            lst = findings.setdefault(k, [])
            lst.extend(m for m in v if m not in lst and len(lst) < 10)

    first = _run(s, lambda ready: ready[0])
    merge(first)
    n_runs, exhaustive = 1, False
    loose = [(w.counter, i) for i, t in enumerate(p.tasks) for w in t.waits if w.threshold < s.final[w.counter]]
    if loose and not first.findings.get("deadlock"):
        if len(p.tasks) <= exhaustive_tasks:
            n_runs, exhaustive = _exhaust(s, merge, max_interleavings)
        else:
            victims = sorted({tid for c, _ in loose for tid, t in enumerate(p.tasks) if t.out_counter == c})
            for v in victims:
                merge(_run(s, lambda ready: ready[0], frozenset([v])))
                merge(_run(s, rng.choice, frozenset([v])))
                n_runs += 2
            for _ in range(runs):
                k = rng.randint(1, max(1, len(victims)))
                merge(_run(s, rng.choice, frozenset(rng.sample(victims, min(k, len(victims))))))
                n_runs += 1
    ok = not any(findings.values())
    return OracleResult(ok, {k: v for k, v in findings.items() if v}, n_runs, exhaustive)


def _exhaust(s: _Static, merge, limit: int) -> tuple[int, bool]:
    """Every interleaving (depth-first), up to ``limit`` complete runs."""
    count = 0
    stack = [_Run(s)]
    while stack:
        r = stack.pop()
        ready = r.runnable() if r.left else []
        if not ready:
            r.finish()
            merge(r)
            count += 1
            if count >= limit:
                return count, False
            continue
        for sm in ready:
            c = r.clone()
            c.findings = {k: list(v) for k, v in r.findings.items()}
            c.step(sm)
            stack.append(c)
    return count, True
