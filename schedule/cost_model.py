"""Predicted latency of a program without a GPU: an event simulation of the per-SM queues.

Each task costs ``bytes / per_sm_bandwidth + overhead``; it starts when its SM is free and every counter it waits
on is complete. Per-SM bandwidth is the HBM bandwidth shared by the SMs that hold work, capped by what one SM can
pull (measured on H100: ~23 GB/s per SM with 16 KB in flight, more with deeper prefetch). KV bytes of attention
tasks are taken at the given context length, not at the cache capacity.
"""
from __future__ import annotations

from schedule.ir import MegakernelProgram, GpuTarget

TASK_OVERHEAD_US = 0.6      # dispatch + wait + block-wide reductions per task
PER_SM_GBPS_BY_DEPTH = {0: 14.0, 1: 20.0, 2: 24.0, 3: 26.0, 4: 27.0}


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
    depth = int(program.config.get("prefetch_depth", 2))
    per_sm = min(t.hbm_gbps / busy, PER_SM_GBPS_BY_DEPTH.get(depth, 24.0) * t.hbm_gbps / 3050.0) * 1e3  # bytes/us
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
                free[sm] = start + task_bytes(program, task, ctx) / per_sm + TASK_OVERHEAD_US
                if task.out_counter >= 0:
                    pending[task.out_counter] -= 1
                    done_at[task.out_counter] = max(done_at[task.out_counter], free[sm])
                heads[sm] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise ValueError("predict_us: the program deadlocks (validate() it first)")
    return max(free)
