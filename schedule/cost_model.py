"""Predicted latency of a program without a GPU: an event simulation of the per-SM queues.

Each task costs ``bytes / per_sm_bandwidth + overhead``; it starts when its SM is free and every counter it waits
on is complete. Per-SM bandwidth is the HBM bandwidth shared by the SMs that hold work, capped by what one SM can
pull (measured on H100: ~23 GB/s per SM with 16 KB in flight, more with deeper prefetch). KV bytes of attention
tasks are taken at the given context length, not at the cache capacity.

Calibration (H100, 2026-11-22, from the first variant sweep only -- docs/PERF.md "sweep A"; later runs are held out):
* per-task overhead ~2.5 us: doubling tile rows (5,098 fewer tasks, ~39 per SM) saved 114 us;
* attention is latency-bound, ~0.05 us per cached position per task: 8 KV splits saved ~28 us per layer at ctx 512;
* L2 look-ahead prefetch did not raise per-SM bandwidth (depth 2 was 7% slower than 0), so it is not modelled.
"""
from __future__ import annotations

from schedule.ir import MegakernelProgram, GpuTarget

TASK_OVERHEAD_US = 2.5      # dispatch + wait + x staging + block-wide reductions per task
PER_SM_GBPS = 23.0          # streaming rate of one SM when every SM streams (3.05 TB/s / 132)
ATTN_US_PER_POSITION = 0.05
PREFETCH_US = 1.0           # one L2_PREFETCH task: wait + issue (assumed, not calibrated)


def attn_positions(task, ctx: int) -> int:
    p = task.params
    n = min(ctx, int(p["max_seq"]))
    return -(-n // int(p["n_splits"])) if task.op == "ATTN_PARTIAL" else n


def task_us(program: MegakernelProgram, task, ctx: int, per_sm: float) -> float:
    """Predicted time of one task on one SM (per_sm: bytes per us). An L2_PREFETCH only issues requests:
    PREFETCH_US (an assumption, not calibrated), and its bytes stay with the consumer."""
    if task.op == "L2_PREFETCH":
        return PREFETCH_US
    t = task_bytes(program, task, ctx) / per_sm + TASK_OVERHEAD_US
    if task.op in ("ATTN_DECODE", "ATTN_PARTIAL"):
        t += ATTN_US_PER_POSITION * attn_positions(task, ctx)
    return t


def task_bytes(program: MegakernelProgram, task, ctx: int) -> int:
    if task.op in ("ATTN_DECODE", "ATTN_PARTIAL"):
        p = task.params
        kv = 2 * min(ctx, int(p["max_seq"])) * int(p["head_dim"]) * program.buffers[task.inputs[1]].dtype.nbytes
        if task.op == "ATTN_PARTIAL":
            kv //= int(p["n_splits"])
        return kv
    return task.est_bytes


def predict_us(program: MegakernelProgram, target: GpuTarget | None = None, ctx: int = 512) -> float:
    t = target or program.target
    busy = sum(1 for q in program.queues if q) or 1
    per_sm = max(t.hbm_gbps / busy, PER_SM_GBPS * t.hbm_gbps / 3050.0) * 1e3   # bytes/us
    done_at = [0.0] * len(program.counters)
    pending = [0] * len(program.counters)
    for task in program.tasks:
        if task.out_counter >= 0:
            pending[task.out_counter] += 1
    heads = [0] * len(program.queues)
    free = [0.0] * len(program.queues)
    left = sum(len(q) for q in program.queues)
    while left:
        progressed = False
        for sm, q in enumerate(program.queues):
            while heads[sm] < len(q):
                task = program.tasks[q[heads[sm]]]
                if any(pending[w.counter] > 0 for w in task.waits):
                    break
                start = max([free[sm]] + [done_at[w.counter] for w in task.waits])
                free[sm] = start + task_us(program, task, ctx, per_sm)
                if task.out_counter >= 0:
                    pending[task.out_counter] -= 1
                    done_at[task.out_counter] = max(done_at[task.out_counter], free[sm])
                heads[sm] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError("predict_us: the program deadlocks (validate() it first)")
    return max(free)
