"""Predicted latency of a program without a GPU: an event simulation of the per-SM queues with shared HBM bandwidth.

What one task costs, in the order the megakernel runs it (vm/csrc/megakernel.cu; segments as measured by
``scripts/trace_breakdown.py --marks``):

    ready      every counter it waits on is complete, plus ``notice_us`` (the polling thread sees the release)
    entry      ``entry_us``: the barrier after the wait, dispatch
    stage      one dependent L2 round trip for its input vector (x, q, partials), plus its bytes at ``stage_gbps``
    main       a first round trip, then its HBM bytes (weights, KV rows at the context) as a *flow*; bytes already
               in L2 (see below) are read at ``l2_gbps``; attention adds ``attn_pos_us`` per position and q head
    tail       stragglers to the closing barrier: ``tail_us`` + ``tail_frac`` x the streaming time (+ per-op extras)
    signal     ``signal_us``: fence + release of the out counter; the SM then takes its next task

Every flow in flight shares the HBM equally, each capped by what one SM can pull (``sm_gbps``): a phase of 32 tasks
streams at 32 x ``sm_gbps``, a phase of 128 at the HBM's rate. A round trip's latency grows with the HBM load at its
start (``l2_us`` + ``l2_load_us`` x load), which is how prefetch traffic during the latency-bound attention chain
costs time (docs/PERF.md, fourth and tenth sessions: every byte added to it measured slower).

Bytes that reach L2 before their task streams them, each a flow of its own that competes for the HBM:
* ``wait_prefetch_kb`` (launch knob): a task that must wait asks L2 for the head of its weights while it waits;
  ``wait_prefetch_next_kb``: and for the head of the next queued task's (``wait_prefetch_pace_kb``, the requests
  spread over the polls, is not modelled: the bytes count as issued when the wait begins);
* L2_PREFETCH tasks (``mlp_prefetch_kb``, requests out ``mlp_prefetch_delay_ns`` after the task starts): matched to
  the consumer tasks whose weight ranges they cover; the requests leave the issuing SM at ``prefetch_drain_gbps``
  (after its earlier prefetch tasks'), and the SM starts its next task only then;
* ``prefetch_depth`` (build knob): each task start asks L2 for the weights of the next queued tasks.
What a consumer finds done is read from L2; what is still in flight joins its own stream. ``preload_kb`` (the
shared-memory preload) and the weight ring (``ring_stages``, ``ring_stage_kb``, ``ring_window``) are not modelled.
An attention task with the ``early_kv`` hint copies the KV history of its first tiles (at most the build's
attention stages, ``EARLY_KV_BYTES``) into shared memory before its wait: when its SM reaches it (hint 1: a flow of
its own), or -- hint 2, ``early_kv`` 'ahead' -- as the task before it on its SM starts: one SM pulls both, so the
copies lengthen that task's stream and have landed when it ends. What has landed when the attention task streams
costs nothing more (it is on chip) and, all of it landed, spares the task its first batch's round trip. (Until the
fortieth session hint 2's copies started after that stream, a flow with a whole SM's cap of its own: 'ahead' was
predicted 4.7% faster on llama-3.2-1b at ctx 8192, measured equal, and 0.5% faster on qwen3-0.6b at ctx 512,
measured 3.0% slower; now -1.0% and +0.3%.) Known miss: 8 attention splits are predicted 0.1-0.2% faster than 4
on both qwen3 presets, measured -1.7% (0.6b) and +1.0% (1.7b) (docs/PERF.md, thirty-ninth and fortieth sessions).

Calibration (H100, ``CALIB``): against the current kernel's measurements in ``docs/measured_ab_h100.jsonl`` (the
tenth- and eleventh-session A/B tables and benches, transcribed from docs/PERF.md) with
``scripts/calibrate_cost_model.py --fit --holdout e11-`` (the eleventh-session groups held out); constants that a
trace measured directly (entry, signal, the fused merge's staging) keep their traced values. Other GPUs scale the
bandwidths with ``hbm_gbps``; their latencies are H100's (not calibrated). A ``predicted`` latency ranks schedules;
it is never a measurement (docs/PERF.md, twelfth session, says how well and where it is still wrong).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq

from schedule.ir import BufferKind, GpuTarget, MegakernelProgram, task_step
from schedule.ops import accesses, is_dyn, weight_ranges
from vm.abi import QKV_MODE_RAW
from vm.smem import ATTN_STAGE_BYTES, ATTN_STAGES

GEMV_OPS = ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN", "QKV_ROPE")
ATTN_OPS = ("ATTN_DECODE", "ATTN_PARTIAL")
ARGMAX_OPS = ("ARGMAX", "ARGMAX_PARTIAL", "ARGMAX_MERGE", "ARGMAX_PAIRS")
H100_GBPS = 3050.0     # the calibration target's hbm_gbps: bandwidths scale from it
NORM_SLOTS = ("norm_w", "qk_norm_w", "q_norm_w", "k_norm_w")   # weights staged with the input, not streamed
WARM_BYTES = 16384     # a task whose prefetch has landed this much starts its stream from L2 (no hbm_us)
EARLY_KV_BYTES = ATTN_STAGES * ATTN_STAGE_BYTES   # an early_kv attention task's copies before its wait (at most)


@dataclasses.dataclass(frozen=True)
class Calib:
    """Cost constants (us; GB/s at the H100's 3050 GB/s). 'fit': scripts/calibrate_cost_model.py --fit (docs/PERF.md,
    twelfth session); 'trace': read off a trace_breakdown.py table; 'set': assumed, too small to fit."""
    bw_eff: float = 1.0              # fit: share of target.hbm_gbps the flows reach (H100 read measured 3066 GB/s)
    sm_gbps: float = 41.86           # fit: what one SM streams alone (64 KB of loads in flight)
    entry_us: float = 0.15           # trace (tenth session): ready -> op entry
    signal_us: float = 0.42          # trace: barrier -> counter released
    notice_us: float = 0.255         # fit: release -> the waiting thread sees it
    l2_us: float = 0.8               # fit: one dependent L2 round trip on an idle HBM
    l2_load_us: float = 0.56         # fit: + this much at full HBM load
    hbm_us: float = 0.4891           # fit: a first weight batch from HBM takes this much more than one from L2
    stage_gbps: float = 83.5705      # fit: input vectors staged from L2, per SM
    l2_gbps: float = 38.85           # fit: prefetched weights read from L2, per SM
    tail_us: float = 0.6222          # fit: stragglers to the closing barrier ...
    tail_frac: float = 0.0149        # fit: ... + this share of the streaming time
    qkv_epilogue_us: float = 0.8682  # fit: RoPE / K-V append after a QKV tile's rows
    qknorm_epilogue_us: float = 3.12  # fit from the trace's 3.0 us: + a whole-head tile's QK-norm
    attn_pos_us: float = 0.0005      # fit: per cached position and q head of an attention task
    attn_tail_us: float = 1.7685     # fit: attention's softmax merge across warps and its partial's store
    merge_us: float = 1.2536         # fit: ATTN_MERGE / QK_NORM_ROPE arithmetic after their loads
    fused_merge_gbps: float = 12.0   # trace (ninth session): an o_proj tile merging the split-KV partials while it
                                     # stages them (stage 1.5 -> 6.3 us for 67 KB of partials)
    prefetch_issue_us: float = 0.2   # set: an L2_PREFETCH task's issue
    prefetch_drain_gbps: float = 100.0  # trace (forty-first session): an SM's own L2_PREFETCH requests leave it at
                                     # ~192 KB per ~2 us; its next task (and a second prefetch task) waits for them
    argmax_gbps: float = 40.0        # set: ARGMAX reading the logits on one SM
    argmax_epilogue_us: float = 0.2  # set: an LM-head tile's block argmax (GEMV has_argmax), not fitted
    launch_us: float = 0.9519        # fit: per step, the launch and block start inside the replayed graph
    threads_ref: int = 512           # sm_gbps holds at this many threads per block (fewer: proportionally less)

    def scaled(self, **kw) -> "Calib":
        return dataclasses.replace(self, **kw)


CALIB = Calib()


def attn_positions(task, ctx: int) -> int:
    """Cached positions one attention task reads at context ``ctx`` (the step writes position ctx, reads 0..ctx)."""
    n = min(ctx + 1, int(task.params["max_seq"]))
    return -(-n // int(task.params["n_splits"])) if task.op == "ATTN_PARTIAL" else n


def task_bytes(program: MegakernelProgram, task, ctx: int) -> int:
    """HBM bytes of one task at context ``ctx``: its weight ranges, or an attention task's K and V rows."""
    if task.op in ATTN_OPS:
        kv = program.buffers[task.inputs[1]]
        return 2 * attn_positions(task, ctx) * int(task.params["head_dim"]) * kv.dtype.nbytes
    if task.op == "EMBED":
        return int(task.params["col_count"]) * program.buffers[task.inputs[0]].dtype.nbytes
    if is_dyn(task.params):   # a claim-group member: its even share of the group's weight rows
        full = sum((a.hi - a.lo) * program.buffers[a.buffer].dtype.nbytes
                   for a in accesses(task, lambda b: program.buffers[b].numel) if a.slot in ("w_gate", "w_up"))
        return -(-full // int(task.params["dyn_tasks"]))
    return sum((a.hi - a.lo) * program.buffers[a.buffer].dtype.nbytes for a in _weights(program, task))


def _weights(program, task):
    if task.op == "L2_PREFETCH" or task.op in GEMV_OPS:
        return weight_ranges(task, lambda b: program.buffers[b].numel)
    return []


def staged_bytes(program: MegakernelProgram, task) -> int:
    """Bytes a task loads from L2 before its main loop: activations (fp32), IO scalars, small constants."""
    if task.op in ("L2_PREFETCH", "EMBED") or task.op in ARGMAX_OPS:
        return 0
    n = 0
    for a in accesses(task, lambda b: program.buffers[b].numel):
        buf = program.buffers[a.buffer]
        streamed = buf.kind in (BufferKind.WEIGHT, BufferKind.KV_CACHE) and a.slot not in NORM_SLOTS
        if a.write or streamed:
            continue
        n += (a.hi - a.lo) * (4 if buf.kind == BufferKind.ACTIVATION else buf.dtype.nbytes)
    return n


class _Flows:
    """Flows sharing the HBM equally, each capped: all progress at one rate, so a virtual clock (bytes moved by a
    flow active since t=0) orders their ends in a heap."""

    def __init__(self, bw: float, cap: float):
        self.bw, self.cap = bw, cap        # bytes / us
        self.v, self.t, self.n = 0.0, 0.0, 0
        self.heap: list[tuple[float, int]] = []
        self.end_v: dict[int, float] = {}  # live flow id -> virtual end
        self.size: dict[int, float] = {}

    def rate(self) -> float:
        return min(self.cap, self.bw / self.n) if self.n else 0.0

    def load(self) -> float:
        return self.n * self.rate() / self.bw

    def advance(self, t: float) -> None:
        self.v += self.rate() * (t - self.t)
        self.t = t

    def add(self, fid: int, nbytes: float) -> None:
        self.end_v[fid], self.size[fid] = self.v + nbytes, nbytes
        heapq.heappush(self.heap, (self.v + nbytes, fid))
        self.n += 1

    def done_bytes(self, fid: int) -> float:
        if fid not in self.end_v:
            return self.size.get(fid, 0.0)
        return self.size[fid] - (self.end_v[fid] - self.v)

    def cancel(self, fid: int) -> float:
        """Stop a live flow; returns the bytes it had moved."""
        done = self.done_bytes(fid)
        if fid in self.end_v:
            del self.end_v[fid]
            self.n -= 1
            self.size[fid] = done   # what a later done_bytes() reports: the bytes it moved, not its size
        return done

    def next_end(self) -> tuple[float, int] | None:
        while self.heap and self.heap[0][1] not in self.end_v:
            heapq.heappop(self.heap)
        if not self.heap:
            return None
        r = self.rate()
        return self.t + max(0.0, self.heap[0][0] - self.v) / r, self.heap[0][1]

    def finish(self, fid: int) -> None:
        del self.end_v[fid]
        self.n -= 1

    def landed(self, fid: int, nbytes: float) -> None:
        """A flow that moved its bytes inside another one (it takes no share of its own): done_bytes and cancel
        report them."""
        self.size[fid] = nbytes


@dataclasses.dataclass
class SimResult:
    """Per-task times (us from the step's start) of one simulated step, indexed like program.tasks: ``ready`` (the
    op entered), ``start`` (its main loop began streaming), ``end`` (its counter released)."""
    ready: list[float]
    start: list[float]
    end: list[float]
    step_us: float          # makespan + launch


class Prepared:
    """The static facts of a program the simulation needs (bytes, staged bytes, prefetch consumers), computed once
    per (program, ctx): a calibration re-simulates the same programs under many constants."""

    def __init__(self, program: MegakernelProgram, ctx: int):
        if ctx < 0:
            raise ValueError(f"predict_us: ctx {ctx} must be >= 0")
        self.program, self.ctx = program, ctx
        n = len(program.tasks)
        self.index = {t.id: i for i, t in enumerate(program.tasks)}
        self.bytes = [task_bytes(program, t, ctx) for t in program.tasks]
        self.staged = [staged_bytes(program, t) for t in program.tasks]
        # an o_proj tile that merges the split-KV partials (x_splits > 0) stages them at fused_merge_gbps instead
        self.merged = [self.staged[i] if int(t.params.get("x_splits", 0)) > 0 else 0
                       for i, t in enumerate(program.tasks)]
        self.staged = [s - m for s, m in zip(self.staged, self.merged)]
        self.positions = [attn_positions(t, ctx) if t.op in ATTN_OPS else 0 for t in program.tasks]
        self.early = [int(t.params.get("early_kv", 0)) if t.op in ATTN_OPS else 0 for t in program.tasks]   # hints
        self.sm_of = [0] * n
        for s, q in enumerate(program.queues):
            for tid in q:
                self.sm_of[self.index[tid]] = s
        self.consumers_of = _prefetch_consumers(program)


def _prefetch_consumers(program: MegakernelProgram) -> dict[int, list[tuple[int, int]]]:
    """{L2_PREFETCH task index: [(consumer task index, bytes of the consumer's weights it covers)]}: the consumers
    of its own decode step (a multi-step launch reads every weight once per step)."""
    by_buf: dict[tuple[int, int], list[tuple[int, int, int]]] = {}   # (step, buffer) -> weight ranges
    for i, t in enumerate(program.tasks):
        if t.op in GEMV_OPS:
            for a in _weights(program, t):
                by_buf.setdefault((task_step(t), a.buffer), []).append((a.lo, a.hi, i))
    for v in by_buf.values():
        v.sort()
    out: dict[int, list[tuple[int, int]]] = {}
    for i, t in enumerate(program.tasks):
        if t.op != "L2_PREFETCH":
            continue
        cov = out.setdefault(i, [])
        for a in _weights(program, t):
            rows = by_buf.get((task_step(t), a.buffer), [])
            k = max(0, bisect.bisect_right(rows, (a.lo, 1 << 62, 0)) - 1)
            while k < len(rows) and rows[k][0] < a.hi:
                lo, hi, ci = rows[k]
                ov = min(hi, a.hi) - max(lo, a.lo)
                if ov > 0:
                    cov.append((ci, ov * program.buffers[a.buffer].dtype.nbytes))
                k += 1
    return out


class _Sim:
    def __init__(self, pre: Prepared, target: GpuTarget, calib: Calib):
        program = pre.program
        self.p, self.c, self.pre = program, calib, pre
        cfg = program.config or {}
        scale = target.hbm_gbps / H100_GBPS
        threads = int(cfg.get("threads_per_block", calib.threads_ref))
        per_sm = calib.sm_gbps * scale * min(1.0, threads / calib.threads_ref)
        self.flows = _Flows(target.hbm_gbps * calib.bw_eff * 1e3, per_sm * 1e3)   # GB/s -> bytes / us
        self.stage_bpu, self.l2_bpu = calib.stage_gbps * scale * 1e3, calib.l2_gbps * scale * 1e3
        self.merge_bpu = calib.fused_merge_gbps * scale * 1e3
        self.wait_pf = int(cfg.get("wait_prefetch_kb", 64)) * 1024
        self.wait_pf_next = int(cfg.get("wait_prefetch_next_kb", 0)) * 1024
        self.depth = int(cfg.get("prefetch_depth", 0))
        grid = max(1, sum(1 for q in program.queues if q))
        self.depth_cap = int(target.l2_bytes * 0.5 / grid / self.depth) if self.depth else 0
        n = len(program.tasks)
        self.index, self.bytes, self.sm_of = pre.index, pre.bytes, pre.sm_of
        self.ready, self.start, self.end = [0.0] * n, [0.0] * n, [0.0] * n
        self.streamed = [False] * n
        self.l2_done = [0.0] * n           # bytes of the task found in L2 when it streams
        self.pf_flows: list[list[int]] = [[] for _ in range(n)]   # prefetch flows that feed task i
        self.early = pre.early
        self.pending = [0] * len(program.counters)
        for t in program.tasks:
            if t.out_counter >= 0:
                self.pending[t.out_counter] += 1
        self.done_at = [0.0] * len(program.counters)
        self.blocked: dict[int, list] = {}       # task -> [open counters left, time its SM reached it]
        self.waiting_on: dict[int, list[int]] = {}   # counter -> tasks blocked on it
        self.timers: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.heads = [0] * len(program.queues)
        self.pf_drained = [0.0] * len(program.queues)   # per SM: when its L2_PREFETCH requests have left it
        self.next_fid = n                   # flow ids: task i streams as flow i; prefetch flows above n

    # ---- prefetch bookkeeping ------------------------------------------------------------------------------
    def _prefetch(self, consumer: int, nbytes: float) -> None:
        if nbytes <= 0 or self.streamed[consumer]:
            return
        fid = self.next_fid
        self.next_fid += 1
        self.flows.add(fid, nbytes)
        self.pf_flows[consumer].append(fid)

    # ---- events --------------------------------------------------------------------------------------------
    def _timer(self, t: float, kind: str, i: int) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (t, self.seq, kind, i))

    def _lat(self) -> float:
        return self.c.l2_us + self.c.l2_load_us * self.flows.load()

    def _next_task(self, sm: int, t: float) -> None:
        q = self.p.queues[sm]
        if self.heads[sm] >= len(q):
            return
        i = self.index[q[self.heads[sm]]]
        self.heads[sm] += 1
        task = self.p.tasks[i]
        if self.early[i] == 1:   # its KV history into shared memory, before its wait
            self._prefetch(i, min(self.bytes[i], EARLY_KV_BYTES))
        if self.depth:   # L2 look-ahead: the next `depth` queued tasks' weights
            for qn in q[self.heads[sm]:self.heads[sm] + self.depth]:
                j = self.index[qn]
                if not self.pf_flows[j] and self.p.tasks[j].op in GEMV_OPS:
                    self._prefetch(j, min(self.bytes[j], self.depth_cap))
        open_counters = [w.counter for w in task.waits if self.pending[w.counter] > 0]
        if open_counters:
            if self.wait_pf and task.op in GEMV_OPS and not self.pf_flows[i]:
                self._prefetch(i, min(self.bytes[i], self.wait_pf))
            if self.wait_pf_next and self.heads[sm] < len(q):   # the next queued task's head as well
                j = self.index[q[self.heads[sm]]]
                if self.p.tasks[j].op in GEMV_OPS and not self.pf_flows[j]:
                    self._prefetch(j, min(self.bytes[j], self.wait_pf_next))
            self.blocked[i] = [len(open_counters), t]
            for k in open_counters:
                self.waiting_on.setdefault(k, []).append(i)
            return
        self._timer(self._ready_at(i, t), "ready", i)

    def _ready_at(self, i: int, since: float) -> float:
        """When task i enters: its SM reached it at ``since``, and every counter it waits on was seen released."""
        return max([since] + [self.done_at[w.counter] + self.c.notice_us for w in self.p.tasks[i].waits])

    def _ready(self, i: int, t: float) -> None:
        c, task = self.c, self.p.tasks[i]
        self.ready[i] = t
        if task.op == "L2_PREFETCH":   # its requests go out delay_ns after it starts
            self._timer(t + c.entry_us + int(task.params.get("delay_ns", 0)) / 1000.0, "issue", i)
            return
        a = c.entry_us
        if task.op in GEMV_OPS or task.op in ATTN_OPS:   # stage the input, then the first batch's round trip
            lat = self._lat()
            landed = sum(self.flows.done_bytes(f) for f in self.pf_flows[i])
            warm = landed >= min(self.bytes[i], WARM_BYTES)
            on_chip = self.early[i] and landed >= min(self.bytes[i], EARLY_KV_BYTES)   # no first batch to fetch
            a += (1 if on_chip else 2) * lat + (0.0 if warm else c.hbm_us) + self.pre.staged[i] / self.stage_bpu
            a += self.pre.merged[i] / self.merge_bpu
        elif task.op in ("ATTN_MERGE", "QK_NORM_ROPE", "RMSNORM", "ADD", "EMBED") or task.op in ARGMAX_OPS:
            a += self._lat() + self.pre.staged[i] / self.stage_bpu
        self._timer(t + a, "stream", i)

    def _issue(self, i: int, t: float) -> None:
        """An L2_PREFETCH task's requests go out: the consumers' prefetch flows start. They leave the SM at
        ``prefetch_drain_gbps`` after any earlier prefetch task's of the same SM, and the SM's next task starts only
        then (its own loads queue behind them)."""
        total = 0
        for ci, nbytes in self.pre.consumers_of.get(i, []):
            self._prefetch(ci, nbytes)
            total += nbytes
        sm = self.pre.sm_of[i]
        self.pf_drained[sm] = max(t, self.pf_drained[sm]) + total / (self.c.prefetch_drain_gbps * 1e3)
        self._timer(max(t + self.c.prefetch_issue_us, self.pf_drained[sm]), "end", i)

    def _stream(self, i: int, t: float) -> None:
        found = sum(self.flows.cancel(f) for f in self.pf_flows[i])    # in L2 now; the rest joins our stream
        found = min(found, self.bytes[i])
        self.l2_done[i] = found
        left = self.bytes[i] - found + self._ahead(i)[1]
        self.start[i], self.streamed[i] = t, True
        if left > 0:
            self.flows.add(i, left)
        else:
            self._after_stream(i, t)

    def _ahead(self, i: int) -> tuple[int, float]:
        """(next task j of i's SM, bytes) where task i issues j's KV history (early_kv 2: the kernel issues it as
        task i starts), else (-1, 0): one SM pulls both, so the copies lengthen task i's own stream and have landed
        when it ends."""
        sm, q = self.sm_of[i], self.p.queues[self.sm_of[i]]
        j = self.index[q[self.heads[sm]]] if self.heads[sm] < len(q) else -1
        return (j, min(self.bytes[j], EARLY_KV_BYTES)) if j >= 0 and self.early[j] == 2 else (-1, 0.0)

    def _after_stream(self, i: int, t: float) -> None:
        """Task i's stream ended at t (it began at self.start[i]): the L2 part, the tail, the signal."""
        c, task = self.c, self.p.tasks[i]
        j, ahead = self._ahead(i)
        if ahead:   # the next task's KV history came with this task's stream: landed
            self.flows.landed(self.next_fid, ahead)
            self.pf_flows[j].append(self.next_fid)
            self.next_fid += 1
        b = (0.0 if self.early[i] else self.l2_done[i] / self.l2_bpu) + c.signal_us * (task.out_counter >= 0)
        if task.op in ATTN_OPS:
            b += c.attn_tail_us + c.attn_pos_us * self.pre.positions[i] * int(task.params["group"])
        elif task.op in GEMV_OPS:
            b += c.tail_us + c.tail_frac * (t - self.start[i])
            if task.op == "QKV_ROPE" and int(task.params.get("mode", 0)) != QKV_MODE_RAW:   # RAW: no epilogue
                b += c.qkv_epilogue_us + c.qknorm_epilogue_us * int(task.params.get("has_qknorm", 0))
        elif task.op in ("ATTN_MERGE", "QK_NORM_ROPE"):
            b += c.merge_us + self._lat()
        elif task.op in ARGMAX_OPS:   # logits read on one SM: all of them, a tile's rows, or one per candidate
            n = {"ARGMAX": "n", "ARGMAX_PARTIAL": "count", "ARGMAX_MERGE": "n_cand", "ARGMAX_PAIRS": "n_cand"}[task.op]
            b += 4 * int(task.params[n]) / (c.argmax_gbps * 1e3) + (self._lat() if task.op == "ARGMAX_MERGE" else 0.0)
        if task.op == "GEMV" and int(task.params.get("has_argmax", 0)):   # the tile's block argmax: one barrier more
            b += c.argmax_epilogue_us
        self._timer(t + b, "end", i)

    def _end(self, i: int, t: float) -> None:
        task = self.p.tasks[i]
        self.end[i] = t
        if task.out_counter >= 0:
            k = task.out_counter
            self.pending[k] -= 1
            self.done_at[k] = max(self.done_at[k], t)
            if self.pending[k] == 0:
                for w in self.waiting_on.pop(k, []):
                    self.blocked[w][0] -= 1
                    if self.blocked[w][0] == 0:
                        self._timer(self._ready_at(w, self.blocked.pop(w)[1]), "ready", w)
        self._next_task(self.sm_of[i], t)

    def run(self) -> SimResult:
        for sm in range(len(self.p.queues)):
            self._next_task(sm, 0.0)
        done = 0
        while True:
            nf = self.flows.next_end()
            if self.timers and (nf is None or self.timers[0][0] <= nf[0]):
                t, _, kind, i = heapq.heappop(self.timers)
                self.flows.advance(t)
                if kind == "ready":
                    self._ready(i, t)
                elif kind == "stream":
                    self._stream(i, t)
                elif kind == "issue":
                    self._issue(i, t)
                else:
                    done += 1
                    self._end(i, t)
            elif nf is not None:
                t, fid = nf
                self.flows.advance(t)
                self.flows.finish(fid)
                if fid < len(self.p.tasks):
                    self._after_stream(fid, t)
            else:
                break
        if done != len(self.p.tasks):
            raise ValueError(f"predict_us: the program deadlocks ({len(self.p.tasks) - done} tasks never ran; "
                             "validate() it first)")
        return SimResult(self.ready, self.start, self.end, max(self.end, default=0.0) + self.c.launch_us)


def simulate(program: MegakernelProgram | Prepared, target: GpuTarget | None = None, ctx: int = 512,
             calib: Calib = CALIB) -> SimResult:
    """One decode step at context ``ctx`` (the step reads positions 0..ctx), simulated. A ``Prepared`` program
    carries its own ctx."""
    pre = program if isinstance(program, Prepared) else Prepared(program, ctx)
    return _Sim(pre, target or pre.program.target, calib).run()


def predict_us(program: MegakernelProgram | Prepared, target: GpuTarget | None = None, ctx: int = 512,
               calib: Calib = CALIB) -> float:
    """Predicted us per decode step (``latency_kind`` 'predicted'): a multi-step launch's time over its steps."""
    pre = program if isinstance(program, Prepared) else Prepared(program, ctx)
    return simulate(pre, target, ctx, calib).step_us / int(pre.program.meta.get("steps_per_launch", 1))
