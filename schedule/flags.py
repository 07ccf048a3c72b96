"""Data-flagged activations (knob ``flag_hops``): which buffers and waits of a lowered program take the flag protocol.

A dependent hop through a counter costs the producer a release (its writes drained first) and the consumer an acquire
poll, a block barrier and then its input's own round trip. With a flagged buffer the producer stores each fp32
element as one 8-byte word (value | the launch's tag << 32) without a fence, and the consumer polls the words it
needs: data and readiness arrive together (vm/csrc/sync.cuh; the seventeenth session's ``scripts/hop_micro.cu``:
-0.4 us per hop alone, up to -1.9 us while other SMs stream).

``apply_flag_hops(buffers, tasks)`` marks

* a buffer ``flagged`` where it is an fp32 ACTIVATION that some task writes and some task reads, every access of
  it is one the kernel implements for the flagged layout (``vm.abi.FLAG_SLOTS``, with the params that must be 0
  there), and no element is written twice (a word's tag names the launch, not the write);
* a task's wait ``data`` where the producers of its counter write some buffer the task reads and every activation
  the task reads is flagged: the task then polls that data instead of spinning on the counter (the producers still
  signal it, and the kernel still looks at it once to prefetch weights while the data is not there). A task that
  reads any plain activation keeps all its counters, since that read may be ordered through them (o_proj split by
  KV group accumulates into x, which down reads as its residual: its wait on the gate/up tiles orders that).

On llama-3.2-1b with 'all' that is the residual stream (x, xmid), the MLP's h and the merged attention output: the
hops merge -> o_proj, o_proj -> gate/up, gate/up -> down and down -> next layer's QKV / LM head. The first layer's x
(EMBED writes it) and the attention side (q, the KV cache, the partials) keep their counters. ``schedule/validate.py``
proves the result (section 6 of its docstring); ``check_flag_hops`` makes lowering fail where it does not hold.

Measured (H100, docs/PERF.md forty-seventh session): slower, so off by default. The median consumer of a flagged hop
does finish earlier (down -> QKV -0.6 us, merge -> o_proj -0.3 us per layer), but each phase's last task and the
streaming phases come later, and a flagged h doubles what each down tile reads (64 KB of words for 32 KB of values).
"""
from __future__ import annotations

from schedule.ir import Buffer, BufferKind, DType, IRError, MegakernelProgram, Task
from schedule.ops import accesses


# knob value -> the writer opcodes whose outputs are flagged: GEMV = the residual stream (o_proj's and down's rows),
# ATTN_MERGE = the merged attention output, GEMV_SILU_MUL = the MLP's h
FLAG_WRITERS = {"all": ("GEMV", "ATTN_MERGE", "GEMV_SILU_MUL"), "residual": ("GEMV",),
                "residual_attn": ("GEMV", "ATTN_MERGE")}


def flaggable(buffers: list[Buffer], tasks: list[Task], acc: dict[int, list], which: str = "all") -> set[int]:
    """Buffer ids the flag protocol can carry (see the module docstring), of those that ``which``'s writer opcodes
    (FLAG_WRITERS) write. ``acc``: task id -> its accesses (schedule.ops.accesses)."""
    from vm.abi import FLAG_SLOTS
    ok = {b.id for b in buffers if b.kind == BufferKind.ACTIVATION and b.dtype == DType.F32}
    writes: dict[int, list[tuple[int, int]]] = {}
    read = set()
    for t in tasks:
        for a in acc[t.id]:
            if a.buffer not in ok:
                continue
            need = FLAG_SLOTS.get(t.op, {}).get(a.slot)
            if need is None or any(int(t.params.get(k, 0)) for k in need) or a.acc or \
                    (a.write and t.op not in FLAG_WRITERS[which]):
                ok.discard(a.buffer)
            elif a.write:
                writes.setdefault(a.buffer, []).append((a.lo, a.hi))
            else:
                read.add(a.buffer)
    out = set()
    for b in ok & read & set(writes):
        ws = sorted(writes[b])
        if all(lo1 >= hi0 for (_, hi0), (lo1, _) in zip(ws, ws[1:])):   # every element written at most once
            out.add(b)
    return out


def apply_flag_hops(buffers: list[Buffer], tasks: list[Task], which: str = "all") -> tuple[int, int]:
    """Mark the flaggable buffers (of ``which``: a key of FLAG_WRITERS) and the waits that only order their data
    (in place). Returns (buffers, waits)."""
    numel = lambda i: buffers[i].numel  # noqa: E731
    acc = {t.id: accesses(t, numel) for t in tasks}
    flagged = flaggable(buffers, tasks, acc, which)
    for b in flagged:
        buffers[b].flagged = True
    written_by: dict[int, set[int]] = {}   # counter -> buffers its producers write
    for t in tasks:
        if t.out_counter >= 0:
            written_by.setdefault(t.out_counter, set()).update(a.buffer for a in acc[t.id] if a.write)
    n_waits = 0
    for t in tasks:
        reads = {a.buffer for a in acc[t.id] if not a.write}
        if not reads & flagged or any(buffers[i].kind == BufferKind.ACTIVATION and i not in flagged for i in reads):
            continue   # a task reading a plain activation keeps its counters: it may be ordered through them
        for w in t.waits:
            if reads & written_by.get(w.counter, set()):
                w.data = True
                n_waits += 1
    return len(flagged), n_waits


def check_flag_hops(program: MegakernelProgram) -> None:
    """The flagged program must still validate: a data wait is no memory edge, and where some plain access was
    ordered only through one (a multi-step launch's KV rows, ordered across its steps through the whole step
    before), the rule above is not enough. Then lowering fails with the validator's first error and the knob
    values that remain (IRError: the harness reports it as REJECTED, field flag_hops)."""
    from schedule.validate import validate
    res = validate(program)
    if not res.ok:
        raise IRError(f"flag_hops={program.config.get('flag_hops')!r}: the flagged program does not validate "
                      f"({res.errors[0]}); a data wait orders only the flagged words it polls -- try a smaller "
                      f"flag_hops choice ('residual') or 'off'")
