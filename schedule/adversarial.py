"""Adversarial schedules for measuring the validator against the oracle (issue 7): deterministic by seed.

* ``random_dag(rng)``: a small *valid* program (3-12 tasks of ADD / GEMV / RMSNORM over 8-element buffers with
  overlapping ranges, random SMs, per-task or shared counters, waits only where queue order does not already imply
  the dependency). Built from a sequential intent, so it is race-free and deadlock-free by construction.
* ``toy_bases()``: real lowered programs of the ``toy`` preset under several configs.
* ``MUTATIONS``: name -> fn(program, rng) -> (description, mutant) or None when it does not apply. They drop/add a
  wait, shift a threshold, move a task to another SM or queue position, duplicate/remove/retarget a producer, alias
  two buffers, make one task read another same-sized buffer, swap a read and a write, create a cycle, shift a
  task's range, retarget a wait.
* ``generate(seed, n)``: the stream of (base, mutation, description, program) the report runs.

Mutants are cheap clones (tasks and queues copied, buffers shared and never modified in place).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Iterator

from schedule import ops
from schedule.ir import (TARGETS, Buffer, BufferKind, Counter, DType, GpuTarget, MegakernelProgram, Task, Wait)
from vm.abi import MAX_WAITS

N = 8                                                    # elements per small buffer
SMALL_TARGET = GpuTarget("small", 4, 49152, 100.0, 1 << 20, "sm_80")
SRC, W, NW = 0, 1, 2                                     # buffer ids of the small programs' inputs


# -- small programs ---------------------------------------------------------------------------------------------
def small_buffers(n_act: int = 3) -> list[Buffer]:
    """0 src (IO_INPUT [N]), 1 w (WEIGHT [N, N]), 2 nw (WEIGHT [N]), 3.. a0..a{n-1} (ACTIVATION [N]), last out."""
    bufs = [Buffer(SRC, "src", BufferKind.IO_INPUT, DType.F32, (N,)),
            Buffer(W, "w", BufferKind.WEIGHT, DType.F32, (N, N), "w"),
            Buffer(NW, "nw", BufferKind.WEIGHT, DType.F32, (N,), "nw")]
    bufs += [Buffer(3 + k, f"a{k}", BufferKind.ACTIVATION, DType.F32, (N,)) for k in range(n_act)]
    bufs.append(Buffer(3 + n_act, "out", BufferKind.IO_OUTPUT, DType.F32, (N,)))
    return bufs


def add_task(tid, a, b, y, start=0, count=N, waits=(), out=-1, sm=0) -> Task:
    return Task(tid, "ADD", [a, b], [y], out, [Wait(c, t) for c, t in waits], {"start": start, "count": count}, sm)


def gemv_task(tid, x, y, row_start=0, row_count=N, waits=(), out=-1, sm=0) -> Task:
    return Task(tid, "GEMV", [x, W], [y], out, [Wait(c, t) for c, t in waits],
                {"row_start": row_start, "row_count": row_count, "k": N, "n": N,
                 "has_norm": 0, "has_bias": 0, "has_residual": 0}, sm)


def norm_task(tid, x, y, waits=(), out=-1, sm=0) -> Task:
    return Task(tid, "RMSNORM", [x, NW], [y], out, [Wait(c, t) for c, t in waits], {"n": N, "eps": 1e-5}, sm)


def make_program(buffers: list[Buffer], tasks: list[Task], n_counters: int, n_sms: int | None = None,
                 name: str = "small") -> MegakernelProgram:
    """Queues from ``task.sm`` in task-list order."""
    n_sms = n_sms if n_sms is not None else max((t.sm for t in tasks), default=0) + 1
    queues: list[list[int]] = [[] for _ in range(n_sms)]
    for t in tasks:
        queues[t.sm].append(t.id)
    target = dataclasses.replace(SMALL_TARGET, sm_count=max(SMALL_TARGET.sm_count, n_sms))
    return MegakernelProgram({"model": name}, target, buffers, [Counter(i, f"c{i}") for i in range(n_counters)],
                             tasks, queues, {})


def random_dag(rng: random.Random, n_tasks: int | None = None, n_sms: int | None = None) -> MegakernelProgram:
    """A valid random program (see the module doc)."""
    for _ in range(100):
        p = _try_random_dag(rng, n_tasks or rng.randint(3, 12), n_sms or rng.randint(1, 4))
        if p is not None:
            return p
    raise RuntimeError("random_dag: could not build a program")  # pragma: no cover


def _try_random_dag(rng: random.Random, n: int, n_sms: int) -> MegakernelProgram | None:
    n_act = rng.randint(1, 3)
    bufs = small_buffers(n_act)
    acts, out, full = list(range(3, 3 + n_act)), 3 + n_act, (1 << N) - 1
    written = {b: 0 for b in acts + [out]}
    written[SRC] = full
    tasks: list[Task] = []
    for k in range(n):
        srcs = [SRC] + acts
        if k == n - 1:
            op, y = "RMSNORM", out
        else:
            op, y = rng.choice(["ADD", "ADD", "GEMV", "RMSNORM"]), rng.choice(acts + [out])
        if op == "ADD":
            s = rng.randrange(N)
            c = rng.randint(1, N - s)
            m = ((1 << c) - 1) << s
            cand = [b for b in srcs if written[b] & m == m]
            t = add_task(k, rng.choice(cand), rng.choice(cand), y, s, c)
        else:
            cand = [b for b in srcs if written[b] == full]
            if op == "GEMV":
                r0 = rng.randrange(N)
                rn = rng.randint(1, N - r0)
                m = ((1 << rn) - 1) << r0
                t = gemv_task(k, rng.choice(cand), y, r0, rn)
            else:
                m, t = full, norm_task(k, rng.choice(cand), y)
        written[y] |= m
        tasks.append(t)
    numel = lambda b: bufs[b].numel  # noqa: E731
    acc = [ops.accesses(t, numel) for t in tasks]
    deps = [{i for i in range(j) for a in acc[i] for b in acc[j]
             if a.buffer == b.buffer and (a.write or b.write) and a.lo < b.hi and b.lo < a.hi
             and bufs[a.buffer].kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT)} for j in range(n)]
    anc: list[set[int]] = []
    last: dict[int, int] = {}
    wait_on: list[list[int]] = []
    for j, t in enumerate(tasks):
        t.sm = rng.randrange(n_sms)
        reach: set[int] = set()
        if t.sm in last:
            reach = anc[last[t.sm]] | {last[t.sm]}
        need = []
        for i in sorted(deps[j], reverse=True):   # latest first: it tends to imply the earlier ones
            if i not in reach:
                need.append(i)
                reach |= anc[i] | {i}
        if len(need) > MAX_WAITS:
            return None
        anc.append(reach)
        wait_on.append(need)
        last[t.sm] = j
    # counters: one per task (80%), then merge some pairs of producers whose waiters all come after both
    ctr = [k if (rng.random() < 0.8 or any(k in w for w in wait_on)) else -1 for k in range(n)]
    for _ in range(rng.randint(0, 2)):
        i1, i2 = rng.randrange(n), rng.randrange(n)
        if i1 == i2 or ctr[i1] < 0 or ctr[i2] < 0 or ctr[i1] == ctr[i2]:
            continue
        g1 = [k for k in range(n) if ctr[k] == ctr[i1]]
        g2 = [k for k in range(n) if ctr[k] == ctr[i2]]
        grp = g1 + g2
        waiters = [j for j in range(n) if any(ctr[i] in (ctr[i1], ctr[i2]) for i in wait_on[j])]
        if all(j > max(grp) for j in waiters):
            old = ctr[i2]
            ctr = [ctr[i1] if c == old else c for c in ctr]
    used = sorted({c for c in ctr if c >= 0})
    remap = {c: k for k, c in enumerate(used)}
    n_prod = {remap[c]: ctr.count(c) for c in used}
    for j, t in enumerate(tasks):
        t.out_counter = remap[ctr[j]] if ctr[j] >= 0 else -1
        cs = sorted({remap[ctr[i]] for i in wait_on[j]})
        if len(cs) > MAX_WAITS:
            return None
        t.waits = [Wait(c, n_prod[c]) for c in cs]
    return make_program(bufs, tasks, len(used), n_sms)


# -- real programs --------------------------------------------------------------------------------------------
TOY_CONFIGS = [dict(num_sms=4), dict(num_sms=8, attn_splits=2, sm_assignment="round_robin"),
               dict(num_sms=6, fuse_norm=False, fuse_residual=False, sm_assignment="lpt"),
               dict(num_sms=3, gemv_rows=32, mlp_rows=64, lm_head_rows=128, qkv_heads=2)]


# a QK-norm (Qwen3) variant of the toy: its QKV tiles split heads and write RAW rows, which QK_NORM_ROPE tasks
# finish (fold_qk_norm off) or the attention tasks themselves, the last split writing the K row (the default)
QK_NORM_CONFIGS = [dict(num_sms=8, attn_splits=2, qkv_head_split=2, fold_qk_norm=False),
                   dict(num_sms=8, attn_splits=2, qkv_head_split=2)]


def toy_bases(configs=None) -> list[MegakernelProgram]:
    """Lowered toy programs, one per config (default: TOY_CONFIGS, plus the toy with QK-norm under each of
    QK_NORM_CONFIGS)."""
    from schedule.graph import ModelGraph, load_model, random_weights
    from schedule.ir import ScheduleConfig
    from schedule.lower import lower
    g = load_model("toy", dtype="f32", seed=0)
    out = [lower(g, TARGETS["h100"], ScheduleConfig(**c), max_seq=64) for c in (configs or TOY_CONFIGS)]
    if configs is None:
        qc = dataclasses.replace(g.config, arch="qwen3", qk_norm=True)
        gq = ModelGraph("toy-qk-norm", qc, random_weights(qc, "f32", 0), "f32")
        out += [lower(gq, TARGETS["h100"], ScheduleConfig(**c), max_seq=64) for c in QK_NORM_CONFIGS]
    return out


# -- mutations ------------------------------------------------------------------------------------------------
def clone(p: MegakernelProgram) -> MegakernelProgram:
    tasks = [dataclasses.replace(t, inputs=list(t.inputs), outputs=list(t.outputs), params=dict(t.params),
                                 waits=[Wait(w.counter, w.threshold) for w in t.waits]) for t in p.tasks]
    return MegakernelProgram(p.meta, p.target, list(p.buffers), list(p.counters), tasks,
                             [list(q) for q in p.queues], p.config)


def _producers(p: MegakernelProgram, c: int) -> list[int]:
    return [t.id for t in p.tasks if t.out_counter == c]


def _place(p: MegakernelProgram, tid: int, sm: int, pos: int) -> None:
    for q in p.queues:
        if tid in q:
            q.remove(tid)
    while sm >= len(p.queues):
        p.queues.append([])
    p.queues[sm].insert(min(pos, len(p.queues[sm])), tid)
    p.tasks[tid].sm = sm


def m_drop_wait(p, rng):
    cand = [t for t in p.tasks if t.waits]
    if not cand:
        return None
    q = clone(p)
    t = q.tasks[rng.choice(cand).id]
    w = t.waits.pop(rng.randrange(len(t.waits)))
    return f"task {t.id}: drop wait ({w.counter}, {w.threshold})", q


def m_add_wait(p, rng):
    if not p.counters:
        return None
    q = clone(p)
    t = rng.choice(q.tasks)
    c = rng.randrange(len(p.counters))
    th = len(_producers(p, c)) or 1
    t.waits.append(Wait(c, th))
    return f"task {t.id}: add wait ({c}, {th})", q


def m_threshold(p, rng):
    cand = [t for t in p.tasks if t.waits]
    if not cand:
        return None
    q = clone(p)
    t = q.tasks[rng.choice(cand).id]
    w = rng.choice(t.waits)
    d = rng.choice([-1, 1])
    w.threshold += d
    return f"task {t.id}: threshold of counter {w.counter} {d:+d} -> {w.threshold}", q


def m_move_sm(p, rng):
    q = clone(p)
    t = rng.choice(q.tasks)
    sm = rng.randrange(min(len(q.queues) + 1, q.target.sm_count))
    pos = rng.randint(0, len(q.queues[sm]) if sm < len(q.queues) else 0)
    _place(q, t.id, sm, pos)
    return f"task {t.id}: move to SM {sm} position {pos}", q


def m_move_pos(p, rng):
    cand = [sm for sm, qq in enumerate(p.queues) if len(qq) > 1]
    if not cand:
        return None
    q = clone(p)
    sm = rng.choice(cand)
    k = rng.randrange(len(q.queues[sm]))
    tid = q.queues[sm][k]
    k2 = max(0, min(len(q.queues[sm]) - 1, k + rng.choice([-3, -2, -1, 1, 2, 3])))
    _place(q, tid, sm, k2)
    return f"task {tid}: move within SM {sm} from {k} to {k2}", q


def m_dup_producer(p, rng):
    cand = [t for t in p.tasks if t.out_counter >= 0]
    if not cand:
        return None
    q = clone(p)
    src = rng.choice(cand)
    t = dataclasses.replace(q.tasks[src.id], id=len(q.tasks), label=src.label + "(dup)")
    t.inputs, t.outputs, t.params = list(t.inputs), list(t.outputs), dict(t.params)
    t.waits = [Wait(w.counter, w.threshold) for w in t.waits]
    q.tasks.append(t)
    sm = rng.randrange(len(q.queues))
    _place(q, t.id, sm, rng.randint(0, len(q.queues[sm])))
    return f"duplicate producer task {src.id} as task {t.id} on SM {sm}", q


def m_remove_producer(p, rng):
    cand = [t for t in p.tasks if t.out_counter >= 0]
    if not cand:
        return None
    q = clone(p)
    t = q.tasks[rng.choice(cand).id]
    c, t.out_counter = t.out_counter, -1
    return f"task {t.id}: no longer signals counter {c}", q


def m_retarget_producer(p, rng):
    if len(p.counters) < 2:
        return None
    q = clone(p)
    t = rng.choice(q.tasks)
    c = rng.randrange(len(p.counters))
    old, t.out_counter = t.out_counter, c
    return f"task {t.id}: out_counter {old} -> {c}", q


def m_retarget_wait(p, rng):
    cand = [t for t in p.tasks if t.waits]
    if not cand or len(p.counters) < 2:
        return None
    q = clone(p)
    t = q.tasks[rng.choice(cand).id]
    w = rng.choice(t.waits)
    c = rng.randrange(len(p.counters))
    old, w.counter, w.threshold = w.counter, c, len(_producers(q, c)) or 1
    return f"task {t.id}: wait on counter {old} -> {c} (threshold {w.threshold})", q


def m_alias(p, rng):
    kinds = (BufferKind.ACTIVATION, BufferKind.KV_CACHE, BufferKind.IO_OUTPUT)
    cand = [b for b in p.buffers if b.kind in kinds]
    pairs = [(a, b) for a in cand for b in cand if a.id != b.id and a.numel == b.numel]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    q = clone(p)
    for t in q.tasks:
        t.inputs = [a.id if x == b.id else x for x in t.inputs]
        t.outputs = [a.id if x == b.id else x for x in t.outputs]
    return f"alias buffer {b.id} '{b.name}' onto {a.id} '{a.name}'", q


def m_retarget_input(p, rng):
    """One task reads another buffer of the same kind and size (e.g. attention reading another layer's cache)."""
    cand = [(t, k, b) for t in p.tasks for k, x in enumerate(t.inputs) for b in p.buffers
            if b.id != x and b.kind == p.buffers[x].kind and b.numel == p.buffers[x].numel
            and b.kind != BufferKind.WEIGHT]
    if not cand:
        return None
    t, k, b = rng.choice(cand)
    q = clone(p)
    old, q.tasks[t.id].inputs[k] = q.tasks[t.id].inputs[k], b.id
    return f"task {t.id}: input {k} reads buffer {b.id} '{b.name}' instead of {old}", q


def m_swap_rw(p, rng):
    cand = [t for t in p.tasks if t.inputs and t.outputs]
    if not cand:
        return None
    q = clone(p)
    t = q.tasks[rng.choice(cand).id]
    k = rng.randrange(len(t.inputs))
    t.inputs[k], t.outputs[0] = t.outputs[0], t.inputs[k]
    return f"task {t.id}: swap input {k} and the output", q


def m_cycle(p, rng):
    cand = [(t, w) for t in p.tasks for w in t.waits if _producers(p, w.counter)]
    if not cand:
        return None
    q = clone(p)
    t, w = rng.choice(cand)
    prod = q.tasks[rng.choice(_producers(p, w.counter))]
    waiter = q.tasks[t.id]
    if waiter.out_counter < 0:
        q.counters = list(q.counters) + [Counter(len(q.counters), "cycle")]
        waiter.out_counter = len(q.counters) - 1
    prod.waits.append(Wait(waiter.out_counter, len(_producers(q, waiter.out_counter))))
    return f"cycle: producer task {prod.id} now waits on waiter task {waiter.id}'s counter", q


RANGE_PARAMS = ("start", "row_start", "head_start", "col_start", "kv_head", "split")


def m_shift_range(p, rng):
    cand = [(t, k) for t in p.tasks for k in RANGE_PARAMS if k in t.params]
    if not cand:
        return None
    q = clone(p)
    t, k = rng.choice(cand)
    t = q.tasks[t.id]
    d = rng.choice([-2, -1, 1, 2])
    t.params[k] += d
    return f"task {t.id}: {k} {d:+d}", q


MUTATIONS: dict[str, Callable] = {
    "drop_wait": m_drop_wait, "add_wait": m_add_wait, "threshold": m_threshold, "move_sm": m_move_sm,
    "move_pos": m_move_pos, "dup_producer": m_dup_producer, "remove_producer": m_remove_producer,
    "retarget_producer": m_retarget_producer, "retarget_wait": m_retarget_wait, "alias": m_alias,
    "swap_rw": m_swap_rw, "cycle": m_cycle, "shift_range": m_shift_range, "retarget_input": m_retarget_input}


def mutate(p: MegakernelProgram, rng: random.Random, kind: str | None = None) -> tuple[str, str, MegakernelProgram]:
    """One applicable mutation (kind chosen at random unless given) -> (kind, description, mutant)."""
    kinds = [kind] if kind else list(MUTATIONS)
    for _ in range(50):
        k = rng.choice(kinds)
        r = MUTATIONS[k](p, rng)
        if r is not None:
            return k, r[0], r[1]
    return "none", "no mutation applies", clone(p)


def generate(seed: int, n: int, toy_share: float = 0.25, valid_share: float = 0.1,
             bases: list[MegakernelProgram] | None = None) -> Iterator[tuple[str, str, str, MegakernelProgram]]:
    """n schedules: (base name, mutation kind, description, program). ``toy_share`` of them mutate lowered toy
    programs, ``valid_share`` are unmutated random DAGs, the rest mutate random DAGs (1 or 2 mutations)."""
    rng = random.Random(seed)
    if bases is None and toy_share > 0:
        bases = toy_bases()
    for k in range(n):
        r = rng.random()
        if bases and r < toy_share:
            bi = rng.randrange(len(bases))
            kind, desc, prog = mutate(bases[bi], rng)
            yield f"toy{bi}", kind, desc, prog
            continue
        base = random_dag(rng)
        if r < toy_share + valid_share:
            yield "dag", "none", "unmutated", base
            continue
        kind, desc, prog = mutate(base, rng)
        if rng.random() < 0.25:
            kind2, desc2, prog = mutate(prog, rng)
            kind, desc = f"{kind}+{kind2}", f"{desc}; {desc2}"
        yield "dag", kind, desc, prog
