"""Per-opcode static facts used by the validator, the cost model and the loader: which element ranges of which
buffers a task reads and writes, and how many HBM bytes / flops it costs.

Regions are half-open element ranges ``[lo, hi)`` of the flattened buffer, except for KV caches: the position of
a cache access is known only at run time, so a KV_CACHE ``[n_kv, S, hd]`` is tracked in *(head, column)*
coordinates: element (h, p, d) maps to ``h*hd + d`` for every position p. Two accesses can touch a common element
only if their (head, column) ranges overlap, so the race check stays sound, and tasks that write disjoint columns
of one head's row (a head split over several QKV tasks) are told apart.
The CPU semantics of each opcode live in ``vm/reference_vm.py``; the opcode table in ``vm/abi.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from vm.abi import OPCODES, QKV_MODE_V


@dataclass(frozen=True)
class Access:
    buffer: int
    lo: int
    hi: int
    write: bool
    slot: str
    acc: bool = False   # an accumulating write (y += ..., atomic): unordered with other accumulations is fine


def slot_map(task) -> dict[str, int]:
    """{slot name: buffer id} for a task (inputs by the opcode's slot order, then outputs)."""
    names = OPCODES[task.op].slots(task.params)
    ids = list(task.inputs) + list(task.outputs)
    return dict(zip(names, ids))


def _p(task, name: str) -> int:
    return int(task.params[name])


def accesses(task, numel) -> list[Access]:
    """Every buffer access of ``task``. ``numel(buffer_id)`` gives a buffer's element count."""
    s = slot_map(task)
    op = task.op
    out: list[Access] = []

    def whole(slot, write=False):
        b = s[slot]
        out.append(Access(b, 0, numel(b), write, slot))

    def rng(slot, lo, hi, write=False, acc=False):
        out.append(Access(s[slot], lo, hi, write, slot, acc))

    if op == "EMBED":
        c0, cn = _p(task, "col_start"), _p(task, "col_count")
        whole("table"); whole("token"); rng("x", c0, c0 + cn, True)
    elif op == "RMSNORM":
        whole("x"); whole("w"); whole("y", True)
    elif op in ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN"):
        r0, rn, K = _p(task, "row_start"), _p(task, "row_count"), _p(task, "k")
        x0 = int(task.params.get("x_start", 0))
        rng("x", x0, x0 + gemv_x_elems(task.params))
        for w in ("w", "w_gate", "w_up"):
            if w in s:
                rng(w, r0 * K, (r0 + rn) * K)
        if "norm_w" in s:
            whole("norm_w")
        if "bias" in s:
            rng("bias", r0, r0 + rn)
        if "residual" in s:
            rng("residual", r0, r0 + rn)
        if op == "GEMV_SILU_MUL_DOWN":   # h stays on chip; the down block [out_n, rn] adds into all of y
            whole("w_down")
            rng("y", 0, _p(task, "out_n"), True, True)
        else:
            rng("y" if op == "GEMV" else "h", r0, r0 + rn, True, bool(task.params.get("accumulate", 0)))
        if "y_copy" in s:
            rng("y_copy", r0, r0 + rn, True)
        if "pairs" in s:   # the tile's (max, index) pair
            k = _p(task, "argmax_slot")
            rng("pairs", 2 * k, 2 * k + 2, True)
    elif op == "QKV_ROPE":
        K = _p(task, "k")
        whole("x"); whole("pos"); whole("inv_freq")
        for opt in ("norm_w", "qk_norm_w"):
            if opt in s:
                whole(opt)
        for a, b in qkv_rows(task):   # rows of w, bias and q / raw q, k; (head, column) of a cache row pos
            rng("w", a * K, b * K)
            if "bias" in s:
                rng("bias", a, b)
            rng("dst", a, b, True)
    elif op in ("ATTN_DECODE", "ATTN_PARTIAL"):
        g, G, hd = _p(task, "kv_head"), _p(task, "group"), _p(task, "head_dim")
        rng("q", g * G * hd, (g + 1) * G * hd)   # (qk_norm: the RAW q rows, finished by the task itself)
        # cache accesses in (head, column) coordinates of the row at pos (the history rows are not this step's)
        if "k_out" in s:   # append_k: the task finishes that K row itself, then reads it
            rng("k_raw", g * hd, (g + 1) * hd)
            whole("k_norm_w")
            rng("k_out", g * hd, (g + 1) * hd, True)
        elif not int(task.params.get("qk_norm", 0)):
            rng("k_cache", g * hd, (g + 1) * hd)
        # (a folded task without append_k reads only K rows before pos: its keys end before pos)
        rng("v_cache", g * hd, (g + 1) * hd)
        for opt in ("q_norm_w", "inv_freq"):
            if opt in s:
                whole(opt)
        whole("pos")
        if op == "ATTN_DECODE":
            rng("out", g * G * hd, (g + 1) * G * hd, True)
        else:
            ns, sp = _p(task, "n_splits"), _p(task, "split")
            row = G * (hd + 2)
            base = (g * ns + sp) * row
            rng("partial", base, base + row, True)
    elif op == "QK_NORM_ROPE":
        g, G, hd = _p(task, "kv_head"), _p(task, "group"), _p(task, "head_dim")
        rng("q_raw", g * G * hd, (g + 1) * G * hd); rng("k_raw", g * hd, (g + 1) * hd)
        for opt in ("pos", "inv_freq", "q_norm_w", "k_norm_w"):
            whole(opt)
        rng("q", g * G * hd, (g + 1) * G * hd, True)
        rng("k_cache", g * hd, (g + 1) * hd, True)   # (head, column) coordinates: the row at pos of head g
    elif op == "ATTN_MERGE":
        g, G, hd, ns = _p(task, "kv_head"), _p(task, "group"), _p(task, "head_dim"), _p(task, "n_splits")
        row = G * (hd + 2)
        rng("partial", g * ns * row, (g + 1) * ns * row)
        rng("out", g * G * hd, (g + 1) * G * hd, True)
    elif op == "ADD":
        a, n = _p(task, "start"), _p(task, "count")
        rng("a", a, a + n); rng("b", a, a + n); rng("y", a, a + n, True)
    elif op == "ARGMAX":
        rng("logits", 0, _p(task, "n")); whole("token", True)
    elif op == "ARGMAX_PARTIAL":
        a, n, k = _p(task, "start"), _p(task, "count"), _p(task, "slot")
        rng("logits", a, a + n); rng("cand", k, k + 1, True)
    elif op == "ARGMAX_MERGE":   # gathers logits at the candidates' indices: any of [0, n), so all of it is read
        rng("logits", 0, _p(task, "n")); rng("cand", 0, _p(task, "n_cand")); whole("token", True)
    elif op == "ARGMAX_PAIRS":
        rng("pairs", 0, 2 * _p(task, "n_cand")); whole("token", True)
    elif op == "L2_PREFETCH":
        a, n = _p(task, "start_a"), _p(task, "count_a")
        rng("w_a", a, a + n)
        if "w_b" in s:
            b, m = _p(task, "start_b"), _p(task, "count_b")
            rng("w_b", b, b + m)
    else:
        raise KeyError(f"no access rule for opcode {op}")
    return out


def gemv_x_elems(p: dict) -> int:
    """Elements of x a GEMV-family task reads from x_start on: k, or with x_splits > 0 the split-KV attention
    partials it merges into its k inputs (k / (x_group*x_head_dim) KV groups of [x_splits, x_group, x_head_dim+2])."""
    K, ns = int(p["k"]), int(p.get("x_splits", 0))
    if ns <= 0:
        return K
    G, hd = int(p.get("x_group", 0)), int(p.get("x_head_dim", 0))
    return K // max(1, G * hd) * ns * G * (hd + 2)


def qkv_rows(task) -> list[tuple[int, int]]:
    """Output row ranges of a QKV_ROPE task: whole heads [h0*hd, (h0+hn)*hd), or with pair_count > 0 the RoPE
    pairs [ps, ps+pc) of head h0: rows h0*hd + [ps, ps+pc) and h0*hd + hd/2 + [ps, ps+pc)."""
    h0, hn, hd = _p(task, "head_start"), _p(task, "head_count"), _p(task, "head_dim")
    ps, pc = int(task.params.get("pair_start", 0)), int(task.params.get("pair_count", 0))
    if not pc:
        return [(h0 * hd, (h0 + hn) * hd)]
    a = h0 * hd + ps
    return [(a, a + pc), (a + hd // 2, a + hd // 2 + pc)]


KV_AHEAD_ISSUERS = ("QKV_ROPE", "GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN")   # may issue the next task's KV


def kv_ahead_issuer_ok(task) -> bool:
    """Whether ``task`` may issue the KV history of the attention task after it in its queue (early_kv 2): a weight
    tile (its time is its streaming, which the copies share) whose op issues no cp.async of its own (a GEMV that
    merges attention partials into x does, and its cp.async wait would also wait for the next task's rows). Small
    latency-bound tasks are not issuers: a QK_NORM_ROPE task, which every attention task of its KV group waits for,
    queued its row loads behind the copies (qwen3-0.6b ctx 8192 +2.4%, docs/PERF.md thirty-seventh session)."""
    return task.op in KV_AHEAD_ISSUERS and not (task.op == "GEMV" and int(task.params.get("x_splits", 0)) > 0)


def is_dyn(p: dict) -> bool:
    """A claim-group member (GEMV_SILU_MUL dyn_rows > 0, vm/abi.py)?"""
    return int(p.get("dyn_rows", 0)) > 0


def _dyn_geom(p: dict) -> tuple[int, int, int, int, int]:
    """(row_start, row_count, dyn_rows, own rows per member S, members N) of a claim-group member."""
    dr = int(p["dyn_rows"])
    return int(p["row_start"]), int(p["row_count"]), dr, int(p.get("dyn_static", 0)) or dr, int(p["dyn_tasks"])


def dyn_first_rows(p: dict) -> tuple[int, int]:
    """(first row, rows) of a claim-group member's own rows [j*S, (j+1)*S), clipped (0 rows past the end)."""
    r0, rn, _, S, _ = _dyn_geom(p)
    a = min(int(p["dyn_index"]) * S, rn)
    return r0 + a, min(S, rn - a)


def dyn_tickets(p: dict) -> int:
    """How many chunks of a claim group go to whoever draws their ticket first: the rows past the members' own."""
    _, rn, dr, S, N = _dyn_geom(p)
    return -(-max(0, rn - N * S) // dr)


def dyn_ticket_rows(p: dict, t: int) -> tuple[int, int]:
    """(first row, rows) of ticket t's chunk [N*S + t*dr, +dr), clipped."""
    r0, rn, dr, S, N = _dyn_geom(p)
    a = N * S + t * dr
    return r0 + a, min(dr, rn - a)


def weight_ranges(task, numel) -> list[Access]:
    """The read accesses of WEIGHT-like slots (streamed, prefetchable). A claim-group member's rows are known only
    at run time: its weights here are those of its own first chunk (what it may prefetch while it waits)."""
    out = [a for a in accesses(task, numel)
           if not a.write and a.slot in ("w", "w_gate", "w_up", "w_down", "table", "w_a", "w_b")]
    if is_dyn(task.params):
        a0, an = dyn_first_rows(task.params)
        K = _p(task, "k")
        out = [Access(a.buffer, a0 * K, (a0 + an) * K, False, a.slot) if a.slot in ("w_gate", "w_up") else a
               for a in out]
    return out


def estimate(task, numel, itemsize) -> tuple[int, int]:
    """(HBM bytes, flops) of a task: weight tiles + KV rows (at full context; a split-KV partial reads its split's
    share) + small vectors. An L2_PREFETCH
    costs nothing here: its bytes are the consumer's, counted there, and moving them does not occupy the SM."""
    if task.op == "L2_PREFETCH":
        return 0, 0
    attn = task.op in ("ATTN_DECODE", "ATTN_PARTIAL")
    # positions an attention task reads at full context: all of its head's, or its split's share of them
    positions = -(-_p(task, "max_seq") // (_p(task, "n_splits") if task.op == "ATTN_PARTIAL" else 1)) if attn else 0
    members = max(1, int(task.params["dyn_tasks"])) if is_dyn(task.params) else 1   # a claim group: an even share
    byts = 0
    for a in accesses(task, numel):
        n = a.hi - a.lo
        if attn and a.slot in ("k_cache", "v_cache"):
            n *= positions
        elif task.op == "EMBED" and a.slot == "table":
            n = _p(task, "col_count")                          # one row of the table, not all of it
        elif task.op == "ARGMAX_MERGE" and a.slot == "logits":
            n = _p(task, "n_cand")                              # one logit per candidate
        elif a.slot == "x" and int(task.params.get("x_splits", 0)) > 0:
            n = _p(task, "k")   # merged attention partials: L2-resident like any activation, counted as the x they make
        elif a.slot in ("w_gate", "w_up", "h"):
            n = -(-n // members)
        byts += n * itemsize(a.buffer)
    flops = 0
    if task.op in ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN"):
        m = 1 if task.op == "GEMV" else 2
        flops = 2 * m * _p(task, "row_count") * _p(task, "k") // members
        if task.op == "GEMV_SILU_MUL_DOWN":
            flops += 2 * _p(task, "row_count") * _p(task, "out_n")
    elif task.op == "QKV_ROPE":
        flops = 2 * sum(b - a for a, b in qkv_rows(task)) * _p(task, "k")
    elif attn:
        flops = 4 * _p(task, "group") * _p(task, "head_dim") * positions
    return byts, flops


__all__ = ["Access", "accesses", "is_dyn", "dyn_first_rows", "dyn_tickets", "dyn_ticket_rows", "gemv_x_elems",
           "qkv_rows", "weight_ranges", "estimate", "slot_map", "QKV_MODE_V"]
