"""SM placement of a lowered program's tasks (schedule/lower.py's last pass): the ``sm_assignment`` policies
(round robin, longest-processing-time, list scheduling by an estimated start time) and the ``early_kv`` hints
they set on attention tasks whose SM idles long enough to load its KV history before its wait."""
from __future__ import annotations

from flywheel.prior import KNOB_BY_NAME
from schedule.ir import IRError, Task, task_step
from schedule.ops import kv_ahead_issuer_ok
from vm.abi import OPCODES

EARLY_KV_OPS = tuple(n for n, spec in OPCODES.items() if "early_kv" in spec.iparams)   # ops with the hint
TASK_OVERHEAD_US = 0.6   # fixed per-task cost (wait, dispatch, reductions) used for balance


def assign_steps(tasks: list[Task], n_sms: int, policy: str, bw_per_sm: float, hints: str = "auto",
                 steps: int = 1, placement: str = "continue") -> list[list[int]]:
    """``assign`` for a program of ``steps`` decode steps (steps_per_launch). 'continue': one policy run over every
    task. 'replicate': the policy places step 0's tasks (as in the one-step program), and each later step's k-th task
    takes the SM and the early_kv hint of step 0's k-th task (lower emits the same task sequence per step; checked
    op by op). A queue holds its step-0 tasks, then the same tasks of step 1, and so on: every step runs as the
    one-step placement does, step s+1's tasks queued behind all of step s's on their SM."""
    if steps <= 1 or placement == "continue":
        return assign(tasks, n_sms, policy, bw_per_sm, hints)
    if placement != "replicate":
        raise IRError(f"step_placement: unknown value {placement!r} "
                      f"(choices: {KNOB_BY_NAME['step_placement'].choices})")
    by_step: list[list[Task]] = [[] for _ in range(steps)]
    for t in tasks:
        by_step[task_step(t)].append(t)
    first = by_step[0]
    assign(first, n_sms, policy, bw_per_sm, hints)
    for s, ts in enumerate(by_step[1:], 1):
        if len(ts) != len(first) or any(a.op != b.op for a, b in zip(first, ts)):
            raise IRError(f"step_placement replicate: step {s} has {len(ts)} tasks, not step 0's sequence of "
                          f"{len(first)} (ops differ)")
        for a, b in zip(first, ts):
            b.sm = a.sm
            if "early_kv" in a.params:
                b.params["early_kv"] = a.params["early_kv"]
    return _queues(tasks, n_sms)   # emission order is step-major: each queue's step-0 tasks, then step 1's, ...


def _queues(tasks: list[Task], n_sms: int) -> list[list[int]]:
    """Per SM, the ids of its tasks in emission (topological) order."""
    queues: list[list[int]] = [[] for _ in range(n_sms)]
    for t in tasks:
        queues[t.sm].append(t.id)
    return queues


def assign(tasks: list[Task], n_sms: int, policy: str, bw_per_sm: float, hints: str = "auto") -> list[list[int]]:
    """Set task.sm by policy; queues keep emission (topological) order. The list policies also set the early_kv
    hint of a layer's attention tasks when (by the estimate) the SM of every one of them idles before its inputs
    are ready for at least as long as its KV rows take to stream: the kernel then issues those rows before the
    task's wait. Measured on an H100 (docs/PERF.md, thirteenth session): -1.4% on llama-3.2-1b with 'list_idle'
    and 4 splits (all attention tasks on idle SMs); +1.4% with every task of the 'list' placement hinted (queued
    right behind a QKV task of its group, its copies are still in flight when q's load is issued) and +1.5% at ctx
    8192 with only the quarter of the tasks that sit on idle SMs hinted (the phase ends with the unhinted ones)."""
    cost = [t.est_bytes / bw_per_sm * 1e6 + TASK_OVERHEAD_US for t in tasks]
    early: dict[int, bool] = {}   # per layer (q buffer): every attention task has time to load its KV early
    if policy == "round_robin":
        for i, t in enumerate(tasks):
            t.sm = i % n_sms
    elif policy == "lpt":
        load = [0.0] * n_sms
        for i, t in enumerate(tasks):
            sm = min(range(n_sms), key=lambda s: (load[s], s))
            t.sm, load[sm] = sm, load[sm] + cost[i]
    elif policy in ("list", "list_idle"):
        # earliest start; ties (every SM free by the time the task's inputs are ready) go to the lowest SM index
        # ('list') or to the SM idle longest ('list_idle': the task then has the most time to prefetch what it
        # may read before its wait -- its wait_prefetch_kb of weights, an attention task's KV history rows)
        idle = policy == "list_idle"
        free = [0.0] * n_sms
        done: dict[int, float] = {}  # counter -> time its last producer finishes
        for i, t in enumerate(tasks):
            ready = max((done.get(w.counter, 0.0) for w in t.waits), default=0.0)
            sm = min(range(n_sms), key=lambda s: (max(free[s], ready), free[s] if idle else 0.0, s))
            if t.op in EARLY_KV_OPS:   # (keyed by the layer's q buffer) its SM idles as long as its KV takes
                early[t.inputs[0]] = early.get(t.inputs[0], True) and ready - free[sm] >= cost[i] - TASK_OVERHEAD_US
            fin = max(free[sm], ready) + cost[i]
            t.sm, free[sm] = sm, fin
            if t.out_counter >= 0:
                done[t.out_counter] = max(done.get(t.out_counter, 0.0), fin)
    else:
        raise IRError(f"sm_assignment: unknown policy {policy!r} (choices: {KNOB_BY_NAME['sm_assignment'].choices})")
    for t in tasks:   # the early_kv knob: 'auto' = the list policies' estimate above (no hints under other policies)
        if t.op in EARLY_KV_OPS and (hints == "on" or (hints in ("auto", "ahead") and early.get(t.inputs[0], False))):
            t.params["early_kv"] = 1
    queues = _queues(tasks, n_sms)
    # 'ahead': the task before an attention task issues its KV history (vm/csrc: amk_kv_ahead) wherever a weight
    # tile precedes it. Not in 'auto': measured equal to the same program without it once the attention stages
    # were 128-byte aligned (docs/PERF.md, thirty-seventh session)
    if hints == "ahead":
        by_id = {t.id: t for t in tasks}
        for q in queues:
            for prev, cur in zip(q, q[1:]):
                if by_id[cur].op in EARLY_KV_OPS and kv_ahead_issuer_ok(by_id[prev]):
                    by_id[cur].params["early_kv"] = 2
    return queues
