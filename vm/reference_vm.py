"""The CPU reference VM: executes a MegakernelProgram's task tables in fp32, the living spec of every opcode.

* ``REFERENCE[op](vm, task)`` is the semantics of opcode ``op`` (one function per opcode, in one dict).
* Tasks fire in a seeded **random legal order**: at each step a random SM whose queue head has all its waits
  satisfied runs that task (exactly what the GPU may do). No runnable head with work left = deadlock -> error.
* Activation and output buffers are poisoned with NaN before each step, so a missing dependency shows up as NaN.
* The KV cache persists across steps; weights are kept in their own dtype and upcast per tile (like the GPU),
  K/V are rounded to the cache dtype when appended (like the GPU). Attention is exact fp32 math here; the GPU's
  tensor-core path for 2-byte caches also rounds q and the softmax weights to the cache type (a bf16 SDPA does the
  same), which the GPU tests' 2-byte tolerances cover (tests/vm/test_attention_gpu.py).

Usage::

    vm = ReferenceVM(program, weights)          # weights: {state-dict key: tensor}
    logits = vm.step(token_id, pos)             # one decode step -> fp32 [vocab]
"""
from __future__ import annotations

import math
import random

import torch

from schedule.ir import BufferKind, DType, MegakernelProgram, find_weight, name_step, step_name, validate
from schedule.ops import dyn_first_rows, dyn_ticket_rows, dyn_tickets, gemv_x_elems, is_dyn, slot_map
from vm.abi import OPCODES, QKV_MODE_K, QKV_MODE_Q, QKV_MODE_RAW, QKV_MODE_V

TORCH_DTYPES = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16,
                DType.I32: torch.int32}


class VMError(RuntimeError):
    """A program the VM cannot run (deadlock, bad input, missing weight)."""


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [K] fp32, w: [K] any dtype -> fp32
    return x * torch.rsqrt(x.pow(2).mean() + eps) * w.float()


def _merge_partials(parts: torch.Tensor) -> torch.Tensor:
    # parts: [ns, G, hd+2] rows (m, l, o[hd]) of one KV head's splits
    # -> [G, hd]: sum_s o_s e^(m_s - m) / sum_s l_s e^(m_s - m), m = max_s m_s
    m = parts[:, :, 0].max(0).values                              # [G]
    scale = torch.exp(parts[:, :, 0] - m[None])                    # [ns, G]; exp(-inf) = 0 for empty splits
    l = (parts[:, :, 1] * scale).sum(0)
    o = (parts[:, :, 2:] * scale[:, :, None]).sum(0)
    return o / l[:, None]


def _gemv_input(vm, task, s) -> torch.Tensor:
    x0 = int(task.params.get("x_start", 0))
    x = vm.buf(s["x"])[x0:x0 + gemv_x_elems(task.params)]
    ns = int(task.params.get("x_splits", 0))
    if ns:   # x holds split-KV attention partials [n_kv, ns, G, hd+2]: merged here (ATTN_MERGE fused into o_proj)
        G, hd = int(task.params["x_group"]), int(task.params["x_head_dim"])
        parts = x.view(-1, ns, G, hd + 2)
        x = torch.stack([_merge_partials(parts[g]) for g in range(parts.shape[0])]).reshape(-1)
    if task.params.get("has_norm"):
        x = _rmsnorm(x, vm.buf(s["norm_w"]), float(task.params["eps"]))
    return x


def op_embed(vm, t):
    s = slot_map(t)
    tok = int(vm.buf(s["token"])[0])
    V = int(t.params["vocab"])
    if not 0 <= tok < V:
        raise VMError(f"task {t.id} EMBED: token id {tok} outside [0, {V})")
    c0, cn = int(t.params["col_start"]), int(t.params["col_count"])
    vm.buf(s["x"])[c0:c0 + cn] = vm.buf(s["table"])[tok, c0:c0 + cn].float()


def op_rmsnorm(vm, t):
    s = slot_map(t)
    vm.buf(s["y"])[:] = _rmsnorm(vm.buf(s["x"]), vm.buf(s["w"]), float(t.params["eps"]))


def op_gemv(vm, t):
    s = slot_map(t)
    r0, rn = int(t.params["row_start"]), int(t.params["row_count"])
    x = _gemv_input(vm, t, s)
    y = vm.buf(s["w"])[r0:r0 + rn].float() @ x                   # [rn, K] @ [K]
    if t.params.get("has_bias"):
        y = y + vm.buf(s["bias"])[r0:r0 + rn].float()
    if t.params.get("has_residual"):
        y = y + vm.buf(s["residual"])[r0:r0 + rn]
    if t.params.get("accumulate"):   # y += (the GPU adds atomically, in whatever order the tasks finish)
        vm.buf(s["y"])[r0:r0 + rn] += y
    else:
        vm.buf(s["y"])[r0:r0 + rn] = y
    if t.params.get("has_copy"):     # the same rows into a second buffer
        vm.buf(s["y_copy"])[r0:r0 + rn] = y
    if t.params.get("has_argmax"):   # the tile's (max, row index): the first row on ties, NaN counts as the max
        i = _first_argmax(y)
        k = int(t.params["argmax_slot"])
        vm.buf(s["pairs"])[2 * k:2 * k + 2] = torch.tensor([float(y[i]), float(r0 + i)])


def _silu_mul(vm, t, s, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """silu(Wg[r0:r0+rn] . f(x)) * (Wu[r0:r0+rn] . f(x)), fp32 [rn]; rows = (r0, rn), default the task's."""
    r0, rn = rows or (int(t.params["row_start"]), int(t.params["row_count"]))
    x = _gemv_input(vm, t, s)
    g = vm.buf(s["w_gate"])[r0:r0 + rn].float() @ x
    u = vm.buf(s["w_up"])[r0:r0 + rn].float() @ x
    return torch.nn.functional.silu(g) * u


def _claimed_rows(vm, t) -> list[tuple[int, int]]:
    """The (first row, rows) ranges a claim-group member computes this step (abi.py, GEMV_SILU_MUL dyn_rows): its
    own rows, then the chunks of the tickets it draws from the group's claim counter. The members run one after
    another here, so the draws model any interleaving: each member draws a random number of the tickets left, the
    group's last member all of them (the GPU's members draw until none is left; every partition computes the same
    rows)."""
    P, N = t.params, int(t.params["dyn_tasks"])
    st = vm.claims.setdefault(int(P["dyn_claim"]), [0, 0])   # [tickets drawn, members run]
    st[1] += 1
    left = max(0, dyn_tickets(P) - st[0])
    take = left if st[1] >= N else vm.rng.randint(0, left)
    rows = [r for r in [dyn_first_rows(P)] + [dyn_ticket_rows(P, st[0] + k) for k in range(take)] if r[1] > 0]
    st[0] += take
    vm.claim_log.append((t.id, rows))
    return rows


def op_gemv_silu_mul(vm, t):
    s = slot_map(t)
    r0, rn = int(t.params["row_start"]), int(t.params["row_count"])
    if not is_dyn(t.params):
        vm.buf(s["h"])[r0:r0 + rn] = _silu_mul(vm, t, s)
        return
    for a, n in _claimed_rows(vm, t):
        vm.buf(s["h"])[a:a + n] = _silu_mul(vm, t, s, (a, n))


def op_gemv_silu_mul_down(vm, t):
    """y[0:out_n] += w_down . h for the tile's h (never written to memory); the GPU adds atomically."""
    s = slot_map(t)
    n = int(t.params["out_n"])
    vm.buf(s["y"])[:n] += vm.buf(s["w_down"]).float() @ _silu_mul(vm, t, s)   # [out_n, rn] @ [rn]


def _rotate(x1: torch.Tensor, x2: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    # pairs (x1[i], x2[i]) at angle pos * inv_freq[i] -> cat(rotated x1, rotated x2) along the last dim
    ang = float(pos) * inv_freq                                   # fp32
    cos, sin = torch.cos(ang), torch.sin(ang)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [hn, hd]; rotate-half convention (HF Llama): pairs (i, i + hd/2)
    half = x.shape[-1] // 2
    return _rotate(x[:, :half], x[:, half:], pos, inv_freq)


def _qk_norm(y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # y: [n, hd] fp32; RMSNorm over each head's hd values, times the (shared) per-dim weight
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def op_qkv_rope(vm, t):
    s = slot_map(t)
    p = t.params
    h0, hn, hd, mode = int(p["head_start"]), int(p["head_count"]), int(p["head_dim"]), int(p["mode"])
    pos = int(vm.buf(s["pos"])[0])
    S = int(p["max_seq"])
    if not 0 <= pos < S:
        raise VMError(f"task {t.id} QKV_ROPE: position {pos} outside the KV cache [0, {S})")
    x = _gemv_input(vm, t, s)
    ps, pc = int(p.get("pair_start", 0)), int(p.get("pair_count", 0))
    if pc:   # RoPE pairs [ps, ps+pc) of head h0: rows ps.. and hd/2+ps.. of the head
        half = hd // 2
        rows = torch.cat([torch.arange(ps, ps + pc), torch.arange(half + ps, half + ps + pc)]) + h0 * hd
        y = vm.buf(s["w"])[rows].float() @ x                     # [2*pc]: (a_i..., b_i...)
        if p.get("has_bias"):
            y = y + vm.buf(s["bias"])[rows].float()
        if mode in (QKV_MODE_Q, QKV_MODE_K):
            y = _rotate(y[:pc], y[pc:], pos, vm.buf(s["inv_freq"]).float()[ps:ps + pc])
        dst = vm.buf(s["dst"])
        if mode in (QKV_MODE_Q, QKV_MODE_RAW):
            dst[rows] = y
        elif mode in (QKV_MODE_K, QKV_MODE_V):
            dst[h0, pos, rows - h0 * hd] = y.to(dst.dtype)
        else:
            raise VMError(f"task {t.id} QKV_ROPE: bad mode {mode}")
        return
    y = vm.buf(s["w"])[h0 * hd:(h0 + hn) * hd].float() @ x        # [hn*hd]
    if p.get("has_bias"):
        y = y + vm.buf(s["bias"])[h0 * hd:(h0 + hn) * hd].float()
    y = y.view(hn, hd)
    if mode in (QKV_MODE_Q, QKV_MODE_K):
        if p.get("has_qknorm"):
            y = _qk_norm(y, vm.buf(s["qk_norm_w"]), float(p["qk_eps"]))
        y = _rope(y, pos, vm.buf(s["inv_freq"]))
    dst = vm.buf(s["dst"])
    if mode in (QKV_MODE_Q, QKV_MODE_RAW):
        dst[h0 * hd:(h0 + hn) * hd] = y.reshape(-1)
    elif mode in (QKV_MODE_K, QKV_MODE_V):
        dst[h0:h0 + hn, pos, :] = y.to(dst.dtype)                 # cache: [n_kv, S, hd]
    else:
        raise VMError(f"task {t.id} QKV_ROPE: bad mode {mode}")


def op_qk_norm_rope(vm, t):
    """QK-norm + RoPE of one KV group from the RAW rows of the QKV tasks: q heads [g*G, (g+1)*G) into q, and the
    group's K row into the cache at pos (the same math as QKV_ROPE with has_qknorm on whole heads)."""
    s = slot_map(t)
    p = t.params
    g, G, hd, S = (int(p[k]) for k in ("kv_head", "group", "head_dim", "max_seq"))
    pos = int(vm.buf(s["pos"])[0])
    if not 0 <= pos < S:
        raise VMError(f"task {t.id} QK_NORM_ROPE: position {pos} outside the KV cache [0, {S})")
    eps, inv = float(p["eps"]), vm.buf(s["inv_freq"])
    q = vm.buf(s["q_raw"])[g * G * hd:(g + 1) * G * hd].view(G, hd)
    vm.buf(s["q"])[g * G * hd:(g + 1) * G * hd] = _norm_rope(q, vm.buf(s["q_norm_w"]), eps, pos, inv).reshape(-1)
    _finish_k_row(vm, s, "k_cache", g, hd, pos, eps, inv)


def _norm_rope(rows: torch.Tensor, w: torch.Tensor, eps: float, pos: int, inv: torch.Tensor) -> torch.Tensor:
    """QK-norm then RoPE of RAW rows [n, hd] (QK_NORM_ROPE and the attention ops' folded QK-norm)."""
    return _rope(_qk_norm(rows.float(), w, eps), pos, inv)


def _finish_k_row(vm, s, cache_slot: str, g: int, hd: int, pos: int, eps: float, inv: torch.Tensor) -> None:
    """cache[g, pos] = the group's RAW K row (k_raw) QK-normed (k_norm_w) and rotated, in the cache dtype."""
    kc = vm.buf(s[cache_slot])
    k = vm.buf(s["k_raw"])[g * hd:(g + 1) * hd].view(1, hd)
    kc[g, pos, :] = _norm_rope(k, vm.buf(s["k_norm_w"]), eps, pos, inv)[0].to(kc.dtype)


def _attn_range(vm, t, s) -> tuple[int, int]:
    L = int(vm.buf(s["pos"])[0]) + 1
    w = int(t.params.get("window", 0))
    return (max(0, L - w) if w > 0 else 0), L


def _attn_q(vm, t, s) -> torch.Tensor:
    """The group's q rows [G, hd]: the q buffer's, or (qk_norm) finished from the RAW rows it holds with
    QK_NORM_ROPE's math -- and with append_k the group's K row at pos too, into the cache (k_out), before any read
    of that row (the task whose keys end at pos)."""
    p = t.params
    g, G, hd = int(p["kv_head"]), int(p["group"]), int(p["head_dim"])
    q = vm.buf(s["q"])[g * G * hd:(g + 1) * G * hd].view(G, hd)
    if not int(p.get("qk_norm", 0)):
        return q
    pos, eps, inv = int(vm.buf(s["pos"])[0]), float(p["qk_eps"]), vm.buf(s["inv_freq"])
    if not 0 <= pos < int(p["max_seq"]):
        raise VMError(f"task {t.id} {t.op}: position {pos} outside the KV cache [0, {p['max_seq']})")
    if int(p.get("append_k", 0)):
        _finish_k_row(vm, s, "k_out", g, hd, pos, eps, inv)
    return _norm_rope(q, vm.buf(s["q_norm_w"]), eps, pos, inv)


def _attn_scores(vm, t, s, lo, hi, q):
    p = t.params
    g = int(p["kv_head"])
    k = vm.buf(s["k_cache"])[g, lo:hi].float()                    # [n, hd]
    v = vm.buf(s["v_cache"])[g, lo:hi].float()
    return (q @ k.T) * float(p["scale"]), v                        # [G, n], [n, hd]


def op_attn_decode(vm, t):
    s = slot_map(t)
    g, G, hd = int(t.params["kv_head"]), int(t.params["group"]), int(t.params["head_dim"])
    lo, hi = _attn_range(vm, t, s)
    sc, v = _attn_scores(vm, t, s, lo, hi, _attn_q(vm, t, s))
    vm.buf(s["out"])[g * G * hd:(g + 1) * G * hd] = (torch.softmax(sc, -1) @ v).reshape(-1)


def op_attn_partial(vm, t):
    s = slot_map(t)
    p = t.params
    g, G, hd, ns, sp = (int(p[k]) for k in ("kv_head", "group", "head_dim", "n_splits", "split"))
    lo, hi = _attn_range(vm, t, s)
    n = hi - lo
    a, b = lo + (n * sp) // ns, lo + (n * (sp + 1)) // ns
    part = vm.buf(s["partial"]).view(-1, ns, G, hd + 2)[g, sp]    # [G, hd+2] = (m, l, o[hd])
    q = _attn_q(vm, t, s)
    if b <= a:
        part[:, 0], part[:, 1], part[:, 2:] = -math.inf, 0.0, 0.0
        return
    sc, v = _attn_scores(vm, t, s, a, b, q)
    m = sc.max(-1).values
    e = torch.exp(sc - m[:, None])
    part[:, 0], part[:, 1], part[:, 2:] = m, e.sum(-1), e @ v


def op_attn_merge(vm, t):
    s = slot_map(t)
    g, G, hd, ns = (int(t.params[k]) for k in ("kv_head", "group", "head_dim", "n_splits"))
    parts = vm.buf(s["partial"]).view(-1, ns, G, hd + 2)[g]      # [ns, G, hd+2]
    vm.buf(s["out"])[g * G * hd:(g + 1) * G * hd] = _merge_partials(parts).reshape(-1)


def op_add(vm, t):
    s = slot_map(t)
    a, n = int(t.params["start"]), int(t.params["count"])
    vm.buf(s["y"])[a:a + n] = vm.buf(s["a"])[a:a + n] + vm.buf(s["b"])[a:a + n]


def op_argmax(vm, t):
    s = slot_map(t)
    n = int(t.params["n"])
    vm.buf(s["token"])[0] = int(torch.argmax(vm.buf(s["logits"])[:n]))


def _first_argmax(v: torch.Tensor) -> int:
    """Index of the first maximum of a 1-D fp32 tensor, a NaN counting as the maximum (torch.argmax's rule)."""
    nan = torch.isnan(v)
    if bool(nan.any()):
        return int(nan.nonzero()[0, 0])
    return int((v == v.max()).nonzero()[0, 0])


def op_argmax_partial(vm, t):
    """cand[slot] = start + first argmax of logits[start:start+count] (an index of the whole vector)."""
    s = slot_map(t)
    a, n = int(t.params["start"]), int(t.params["count"])
    vm.buf(s["cand"])[int(t.params["slot"])] = a + _first_argmax(vm.buf(s["logits"])[a:a + n])


def op_argmax_merge(vm, t):
    """token = the candidate whose logit is largest, the first candidate on ties (NaN counts as the maximum)."""
    s = slot_map(t)
    cand = vm.buf(s["cand"])[:int(t.params["n_cand"])].long()
    n = int(t.params["n"])
    if bool(((cand < 0) | (cand >= n)).any()):
        raise VMError(f"task {t.id} ({t.label}): a candidate index outside [0, {n}): {cand.tolist()}")
    vm.buf(s["token"])[0] = int(cand[_first_argmax(vm.buf(s["logits"])[cand])])


def op_argmax_pairs(vm, t):
    """token = the index of the first pair with the largest value (NaN counts as the maximum); with the pairs of
    ascending disjoint row tiles covering the vocabulary, that is argmax(logits) (first index on ties)."""
    s = slot_map(t)
    pairs = vm.buf(s["pairs"])[:2 * int(t.params["n_cand"])].view(-1, 2)
    vm.buf(s["token"])[0] = int(pairs[_first_argmax(pairs[:, 0]), 1])


def op_l2_prefetch(vm, t):
    """A cache hint on the GPU: no buffer changes (the ranges are checked by the validator like any read)."""


REFERENCE = {"EMBED": op_embed, "RMSNORM": op_rmsnorm, "GEMV": op_gemv, "GEMV_SILU_MUL": op_gemv_silu_mul,
             "QKV_ROPE": op_qkv_rope, "QK_NORM_ROPE": op_qk_norm_rope, "ATTN_DECODE": op_attn_decode,
             "ATTN_PARTIAL": op_attn_partial, "ATTN_MERGE": op_attn_merge, "ADD": op_add, "ARGMAX": op_argmax,
             "ARGMAX_PARTIAL": op_argmax_partial, "ARGMAX_MERGE": op_argmax_merge, "ARGMAX_PAIRS": op_argmax_pairs,
             "L2_PREFETCH": op_l2_prefetch, "GEMV_SILU_MUL_DOWN": op_gemv_silu_mul_down}
assert set(REFERENCE) == set(OPCODES), "every opcode needs a reference function"


class ReferenceVM:
    """Runs a program on CPU. ``check=True`` refuses programs ``validate()`` rejects."""

    UPCAST_LIMIT_BYTES = 8 * 2**30

    def __init__(self, program: MegakernelProgram, weights: dict[str, torch.Tensor], seed: int = 0,
                 check: bool = True, order: str = "random", upcast: bool | None = None):
        """``upcast``: keep fp32 copies of 16-bit weights (same values; saves the per-tile upcast). Default: on
        when the fp32 copies fit in UPCAST_LIMIT_BYTES."""
        if check:
            res = validate(program)
            if not res.ok:
                raise VMError("program rejected by validate():\n" + res.report())
        self.program = program
        self.rng = random.Random(seed)
        self.order = order
        self.mem: dict[int, torch.Tensor] = {}
        self.trace: list[int] = []
        if upcast is None:
            upcast = sum(b.numel for b in program.buffers if b.kind == BufferKind.WEIGHT) * 4 <= self.UPCAST_LIMIT_BYTES
        self.upcast = upcast
        for b in program.buffers:
            self.mem[b.id] = self._materialize(b, weights)
        self._io = {b.name: b.id for b in program.buffers if b.kind in (BufferKind.IO_INPUT, BufferKind.IO_OUTPUT)}

    def _materialize(self, b, weights) -> torch.Tensor:
        if b.kind == BufferKind.WEIGHT:
            w = find_weight(b, weights, VMError).to(TORCH_DTYPES[b.dtype])          # round to the program's weight dtype (no-op if equal)
            return w.float() if self.upcast else w
        if b.kind == BufferKind.CONST:
            return torch.tensor(b.data, dtype=TORCH_DTYPES[b.dtype]).view(b.shape)
        if b.kind == BufferKind.KV_CACHE:
            return torch.zeros(b.shape, dtype=TORCH_DTYPES[b.dtype])
        # Activations are always fp32 on the VM; ints stay ints.
        dt = torch.int32 if b.dtype == DType.I32 else torch.float32
        return torch.zeros(b.numel, dtype=dt)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """{state-dict key: the tensor this VM computes with} (fp32 when upcast)."""
        out = {b.source: self.mem[b.id] for b in self.program.buffers if b.kind == BufferKind.WEIGHT and b.cols is None}
        blocks: dict[str, list] = {}   # column-sliced buffers (o_proj split by KV group): put back together
        for b in self.program.buffers:
            if b.kind == BufferKind.WEIGHT and b.cols is not None and b.source not in out:
                blocks.setdefault(b.source, {})[b.cols] = self.mem[b.id]
        for src, parts in blocks.items():
            keys = sorted(parts)
            if keys[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(keys, keys[1:])):
                out[src] = torch.cat([parts[k] for k in keys], dim=1)
        return out

    def buf(self, bid: int) -> torch.Tensor:
        return self.mem[bid]

    def io(self, name: str) -> torch.Tensor:
        return self.mem[self._io[name]]

    def _poison(self) -> None:
        for b in self.program.buffers:
            if b.kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT):
                t = self.mem[b.id]
                t.fill_(-(2**31) if t.dtype == torch.int32 else float("nan"))

    def run(self) -> None:
        """Run every task once, in a random legal order (or queue-major if order='sequential').

        A queue head is *ready* when all its waits are met; readiness is tracked incrementally (an SM blocked on a
        counter is re-checked only when that counter is incremented)."""
        prog = self.program
        counters = [0] * len(prog.counters)
        heads = [0] * len(prog.queues)
        blocked: dict[int, list[tuple[int, int]]] = {}   # counter -> (threshold, SM) of heads waiting on it
        ready: list[int] = []
        self.trace = []
        self.claims: dict[int, list[int]] = {}   # claim counter -> [tickets drawn, members run] (claim groups)
        self.claim_log: list[tuple[int, list]] = []   # (member task id, its (first row, rows) ranges), in run order

        def admit(sm: int) -> None:
            if heads[sm] == len(prog.queues[sm]):
                return
            t = prog.tasks[prog.queues[sm][heads[sm]]]
            for w in t.waits:
                if counters[w.counter] < w.threshold:
                    blocked.setdefault(w.counter, []).append((w.threshold, sm))
                    return
            ready.append(sm)

        for sm in range(len(prog.queues)):
            admit(sm)
        remaining = sum(len(q) for q in prog.queues)
        while remaining:
            if not ready:
                stuck = [(sm, prog.queues[sm][heads[sm]]) for sm in range(len(prog.queues))
                         if heads[sm] < len(prog.queues[sm])][:4]
                raise VMError(f"deadlock: {remaining} task(s) left, no queue head runnable; e.g. "
                              + ", ".join(f"SM {sm} task {tid} ({prog.tasks[tid].op}) waits "
                                          f"{[(w.counter, w.threshold, counters[w.counter]) for w in prog.tasks[tid].waits]}"
                                          for sm, tid in stuck))
            if self.order == "sequential":
                ready.sort()
                sm = ready.pop(0)
            else:
                i = self.rng.randrange(len(ready))
                ready[i], ready[-1] = ready[-1], ready[i]
                sm = ready.pop()
            t = prog.tasks[prog.queues[sm][heads[sm]]]
            REFERENCE[t.op](self, t)
            self.trace.append(t.id)
            heads[sm] += 1
            remaining -= 1
            admit(sm)
            if t.out_counter >= 0:
                c = t.out_counter
                counters[c] += 1
                waiting = blocked.get(c)
                if waiting and any(th <= counters[c] for th, _ in waiting):
                    blocked[c] = [(th, o) for th, o in waiting if th > counters[c]]
                    for th, o in waiting:
                        if th <= counters[c]:
                            admit(o)

    @property
    def n_steps(self) -> int:
        """Decode steps per launch: 1 + the IO inputs 'pos@1', 'pos@2', ... (schedule/lower.py step_io)."""
        return 1 + sum(1 for n in self._io if name_step(n, "pos"))

    def step(self, token: int, pos: int) -> torch.Tensor:
        """One launch: token at position pos -> its logits (fp32, [vocab]). Also sets io('next_token'). A
        multi-step program then runs its greedy steps s = 1.. at pos + s (the GPU's pos@s = pos[s], set by the
        launch): their logits are step_logits()[s], their tokens io('next_token@s')."""
        self._poison()
        self.io("token")[0] = int(token)
        for st in range(self.n_steps):
            self.io(step_name("pos", st))[0] = int(pos) + st
        self.run()
        return self.io("logits").clone()

    def step_logits(self) -> list[torch.Tensor]:
        """Every step's logits of the last launch, in step order."""
        return [self.io(step_name("logits", st)).clone() for st in range(self.n_steps)]

    def reset(self) -> None:
        for b in self.program.buffers:
            if b.kind == BufferKind.KV_CACHE:
                self.mem[b.id].zero_()
