"""Lowering: ModelGraph + GpuTarget + ScheduleConfig -> MegakernelProgram (one decode step, batch 1).

The step is a tiled task DAG with fine-grained counters (no whole-layer barriers):

    EMBED -> x0
    per layer l:   [RMSNORM]                    (only when fuse_norm=False)
                   QKV_ROPE tiles per head      -> q_l, K/V cache append   counter qkv[l][kv_head]
                   [QK_NORM_ROPE per kv head    -> q_l, K cache row        counter qk[l][kv_head]: QK-norm models
                    whose QKV tiles split heads (qkv_head_split > 1) write RAW rows; this task finishes them]
                   ATTN_DECODE per kv head      (or ATTN_PARTIAL x splits [-> ATTN_MERGE]) waits qkv (or qk)[l][head]
                   GEMV o_proj tiles + residual -> xmid_l                 (or GEMV + ADD when fuse_residual=False);
                                                   with fuse_attn_merge each o_proj task merges the partials itself;
                                                   with o_proj_by_group: x_l += W_o[:, group g] . merge(g's partials),
                                                   tiles per KV group adding atomically into x_l (= xmid_l)
                   [L2_PREFETCH per gate/up tile: mlp_prefetch_kb KB of the tile into L2 (its gate rows first,
                    or the heads of both matrices: mlp_prefetch_from), released by the layer input, the last QKV
                    group or attention (mlp_prefetch_at): HBM is mostly idle during the attention hops]
                   GEMV_SILU_MUL gate/up tiles  -> h_l  (RMSNorm fused; with dyn_mlp_rows one claim group: a
                                                   member per SM takes its own rows, then draws the rest by ticket
                                                   from a claim counter nobody waits on)
                   GEMV down tiles + residual   -> x_{l+1}
                   (fuse_down: GEMV_SILU_MUL_DOWN tiles instead, each adding W_down[:, its rows] . h into x_{l+1},
                    which the o_proj tiles seed with xmid_l: no h buffer, no down hop)
    LM head GEMV tiles (final norm fused) -> logits -> ARGMAX_PARTIAL per tile -> ARGMAX_MERGE -> next_token
    (split_argmax; else one ARGMAX; with argmax_in_lm_head each tile writes its own (max, index) pair and one
    ARGMAX_PAIRS picks among them)

steps_per_launch N > 1 repeats the step N times in one program (one launch): step s+1's EMBED waits on step s's
argmax counter and reads that token on the device, at position pos@(s+1) = pos + s + 1 (step_io); every step has
its own activations, counters and IO outputs (logits@s, next_token@s), the KV caches and weights are shared.

Only the points where a whole vector is inherently needed (RMSNorm inputs, o_proj / down_proj inputs) wait on all
producers; attention for KV head g starts when the QKV tiles of group g are done.
Tasks are emitted in a topological order; each SM's queue keeps that order, so queues are linear extensions.
"""
from __future__ import annotations

import hashlib
import json
import time

from schedule.auto_rules import (IDLE_POLICIES, LM_HEAD_AUTO_ROWS, assignment_for, attn_splits_for, auto_rows,
                                 lm_head_tiles, qkv_reserve, qkv_split_for, rows_for, tiles)
from schedule.graph import ModelGraph, lm_head_key, rope_inv_freq
from schedule.ir import (Buffer, BufferKind, Counter, DType, GpuTarget, IRError, MegakernelProgram, MemSpace,
                         ScheduleConfig, Task, Wait, step_name)
from schedule.flags import apply_flag_hops, check_flag_hops
from schedule.ops import estimate
from schedule.placement import assign_steps as _assign
from schedule.prefetch import mlp_prefetch, prefetch_owners
from vm.abi import QKV_MODE_K, QKV_MODE_Q, QKV_MODE_RAW, QKV_MODE_V
from vm.smem import _pad4, attn_fold_fits, merged_x_floats

DEFAULT_MAX_SEQ = 4096


class _Builder:
    def __init__(self, dtype: DType, sms: int = 1, balance_tiles: bool = False, warps: int = 16,
                 smem_per_block: int = 1 << 30):
        self.dtype = dtype
        self.smem_per_block = smem_per_block   # the target's opt-in shared memory per block, bytes
        self.sms = sms                   # SMs (persistent blocks) the program runs on
        self.warps = warps               # warps per block (threads_per_block / 32): the auto row tiles follow it
        self.balance_sms = sms if balance_tiles else 0   # > 0: GEMV-family row tiles in multiples of this many
        self.buffers: list[Buffer] = []
        self.counters: list[Counter] = []
        self.tasks: list[Task] = []
        self.by_source: dict = {}   # state-dict key (or (key, cols)) -> buffer id
        self.kv_caches: dict[str, int] = {}   # KV cache name -> buffer id (one cache for every step of a launch)
        self.step = 0   # the decode step being emitted (steps_per_launch): its activations, counters and labels
                        # get the suffix "@step" / prefix "s<step>." from step 1 on

    def merged_x_fits(self, merge: dict, k: int, rows: int) -> bool:
        """Whether an o_proj GEMV with these merge params (x_splits, x_group, x_head_dim) fits shared memory with x
        and its staged residual rows (vm/smem.py: the GEMV area)."""
        return 4 * (_pad4(k) + _pad4(rows) + _pad4(merged_x_floats({**merge, "k": k}))) <= self.smem_per_block

    def attn_fold_fits(self, G: int, hd: int) -> bool:
        """Whether an attention task of this geometry can fold the QK-norm (vm/smem.py, default KV stages)."""
        return attn_fold_fits(G, hd, 32 * self.warps)

    def sfx(self, name: str) -> str:
        """name as step ``self.step`` of a multi-step launch calls it (step 0: unchanged)."""
        return step_name(name, self.step)

    def buf(self, name, kind, dtype, shape, source=None, space=MemSpace.RESIDENT, data=None) -> int:
        if kind == BufferKind.ACTIVATION:   # every step of a launch has its own activations
            name = self.sfx(name)
        b = Buffer(len(self.buffers), name, kind, dtype, tuple(shape), source, space, data)
        self.buffers.append(b)
        return b.id

    def weight(self, key: str, shape, cols: tuple[int, int] | None = None) -> int:
        """The WEIGHT buffer of state-dict key (tied weights: one buffer per key); cols: only that column block
        of the 2-D source, stored contiguously."""
        k = key if cols is None else (key, cols)
        if k not in self.by_source:
            name = key if cols is None else f"{key}[:, {cols[0]}:{cols[0] + cols[1]}]"
            self.by_source[k] = self.buf(name, BufferKind.WEIGHT, self.dtype, shape, key, MemSpace.STREAM)
            self.buffers[-1].cols = cols
        return self.by_source[k]

    def act(self, name, n) -> int:
        return self.buf(name, BufferKind.ACTIVATION, DType.F32, (n,))

    def kv_cache(self, name, shape) -> int:
        """The KV_CACHE buffer ``name`` (one per layer and K/V, shared by every step of a launch)."""
        if name not in self.kv_caches:
            self.kv_caches[name] = self.buf(name, BufferKind.KV_CACHE, self.dtype, shape, space=MemSpace.PERSISTENT)
        return self.kv_caches[name]

    def counter(self, name) -> int:
        self.counters.append(Counter(len(self.counters), self.sfx(name)))
        return len(self.counters) - 1

    def task(self, op, inputs, outputs, params, waits=(), out_counter=-1, label="") -> int:
        t = Task(len(self.tasks), op, list(inputs), list(outputs), out_counter,
                 [Wait(c, 0) for c in waits], dict(params), label=f"s{self.step}.{label}" if self.step else label)
        self.tasks.append(t)
        return t.id

    def finalize_thresholds(self) -> None:
        producers = [0] * len(self.counters)
        for t in self.tasks:
            if t.out_counter >= 0:
                producers[t.out_counter] += 1
        for t in self.tasks:
            for w in t.waits:
                w.threshold = producers[w.counter]


def _row_tiles(b: _Builder, n: int, rows: int):
    """Row tiles of a GEMV-family matrix with n output rows: ``rows`` each, or with balance_tiles the tile count
    rounded up to a multiple of the SM count (every SM gets the same number of tiles; sizes differ by <= 1 row)."""
    if b.balance_sms <= 0:
        yield from tiles(n, rows)
        return
    k = -(-n // rows)
    k = min(n, -(-k // b.balance_sms) * b.balance_sms)
    for i in range(k):
        lo, hi = n * i // k, n * (i + 1) // k
        yield lo, hi - lo


def dyn_static_rows(n: int, n_sms: int, dr: int, pct: int) -> int:
    """A claim-group member's own rows (knob dyn_mlp_static): pct % of an even share of the n rows over n_sms
    members, rounded down to a multiple of 4 (at least dr); 0 % = one chunk of dr rows like the drawn ones."""
    return max(dr, n // n_sms * pct // 100 // 4 * 4) if pct else dr


def _gemv(b: _Builder, x, w, y, n, k, rows, wait, out_c, label, norm_w=None, eps=0.0, residual=None, merge=None,
          copy=None):
    """GEMV row tiles of y = W x (+ residual). merge: {x_splits, x_group, x_head_dim} when x is the split-KV
    attention partials, merged by each tile while it stages its input. copy: a second buffer the rows go to."""
    for r0, rn in _row_tiles(b, n, rows):
        ins = [x, w] + ([norm_w] if norm_w is not None else []) + ([residual] if residual is not None else [])
        b.task("GEMV", ins, [y] + ([copy] if copy is not None else []),
               {"row_start": r0, "row_count": rn, "k": k, "n": n, "has_norm": int(norm_w is not None), "has_bias": 0,
                "has_residual": int(residual is not None), "has_copy": int(copy is not None), "eps": eps,
                **(merge or {})},
               [wait], out_c, f"{label}[{r0}:{r0 + rn}]")


def _add(b: _Builder, a, r, y, n, rows, wait, out_c, label):
    for s0, sn in tiles(n, rows):
        b.task("ADD", [a, r], [y], {"start": s0, "count": sn}, [wait], out_c, f"{label}[{s0}:{s0 + sn}]")


def _norm_input(b, cfg, x, x_counter, norm_key, c, name):
    """(input buffer, counter to wait on, fused norm weight or None) for a consumer of RMSNorm(x)."""
    nw = b.weight(norm_key, (c.hidden,))
    if cfg.fuse_norm:
        return x, x_counter, nw
    xn = b.act(name, c.hidden)
    cn = b.counter(name)
    b.task("RMSNORM", [x, nw], [xn], {"n": c.hidden, "eps": c.rms_eps}, [x_counter], cn, name)
    return xn, cn, None


def _residual_gemv(b, cfg, x, w, resid, y, n, k, wait, out_c, label, merge=None, copy=None):
    """y = resid + W x, fused into the tile or as GEMV + ADD tasks (gemv_rows rows per task, 0 = auto); copy: the
    fused tile also writes its rows there (needs fuse_residual)."""
    rows = rows_for(cfg.gemv_rows, n, b.sms, b.warps)
    if cfg.fuse_residual:
        _gemv(b, x, w, y, n, k, rows, wait, out_c, label, residual=resid, merge=merge, copy=copy)
    else:
        tmp, ct = b.act(label + "_tmp", n), b.counter(label + "_tmp")
        _gemv(b, x, w, tmp, n, k, rows, wait, ct, label, merge=merge)
        _add(b, tmp, resid, y, n, rows, ct, out_c, label + "_add")


def qkv_tasks_per_layer(c, qkv_heads: int, head_split: int) -> int:
    """QKV_ROPE tasks of one layer: per KV group its q tiles plus one K and one V task, each split head_split ways."""
    return c.n_kv_heads * (len(list(tiles(c.group, qkv_heads))) + 2) * head_split


def _layer(b: _Builder, g: ModelGraph, cfg: ScheduleConfig, l: int, x: int, cx: int, io: dict, S: int,
           splits: int, hs: int, qkv_first: bool):
    c = g.config
    H, hd, G, nkv = c.hidden, c.head_dim, c.group, c.n_kv_heads
    p = f"model.layers.{l}."
    xin, cin, nw = _norm_input(b, cfg, x, cx, p + "input_layernorm.weight", c, f"xn_attn{l}")
    q = b.act(f"q{l}", c.n_heads * hd)
    kc, vc = b.kv_cache(f"k_cache{l}", (nkv, S, hd)), b.kv_cache(f"v_cache{l}", (nkv, S, hd))
    wq = b.weight(p + "self_attn.q_proj.weight", (c.n_heads * hd, H))
    wk = b.weight(p + "self_attn.k_proj.weight", (nkv * hd, H))
    wv = b.weight(p + "self_attn.v_proj.weight", (nkv * hd, H))
    bias = {m: b.weight(p + f"self_attn.{m}_proj.bias", ((c.n_heads if m == "q" else nkv) * hd,))
            for m in "qkv"} if c.attn_bias else {}
    qkn = {m: b.weight(p + f"self_attn.{m}_norm.weight", (hd,)) for m in "qk"} if c.qk_norm else {}
    by_group = cfg.o_proj_by_group
    # fuse_down acts where o_proj writes whole rows of the residual stream (its tiles seed x_{l+1})
    fuse_down = cfg.fuse_down and cfg.fuse_residual and not by_group
    c_attn = None if by_group else b.counter(f"attn{l}")   # o_proj split by KV group, adding into x in place (_o_proj_by_group)
    partial = b.act(f"attn_partial{l}", nkv * splits * G * (hd + 2)) if splits > 1 or by_group else None
    # o_proj merges the partials itself (no ATTN_MERGE hop) where they fit its shared memory next to x and the
    # residual rows (the loader checks the launch's total)
    merge = {"x_splits": splits, "x_group": G, "x_head_dim": hd}
    if not (splits > 1 and cfg.fuse_attn_merge
            and b.merged_x_fits(merge, c.n_heads * hd, rows_for(cfg.gemv_rows, H, b.sms, b.warps))) and not by_group:
        merge = None
    attn = None if merge else b.act(f"attn{l}", c.n_heads * hd)
    scale = hd ** -0.5
    window = int(c.sliding_window or 0)
    # head split hs: QKV tasks per head, each a slice of the RoPE pairs (needs whole heads otherwise). With QK-norm
    # (a per-head RMS) the split tasks write RAW rows and one QK_NORM_ROPE task per KV group finishes them.
    raw = bool(qkn) and hs > 1
    q_raw = b.act(f"q_raw{l}", c.n_heads * hd) if raw else None
    k_raw = b.act(f"k_raw{l}", nkv * hd) if raw else None
    # fold_qk_norm: the attention tasks finish the RAW rows themselves (no QK_NORM_ROPE hop); the task whose keys
    # end at pos (the last split) writes the group's new K row
    fold = raw and cfg.fold_qk_norm and b.attn_fold_fits(G, hd)

    def _attention(kvh: int, c_qk: int) -> int | None:
        """One KV group's attention tasks; the counter its ATTN_MERGE waits on (None: no merge task)."""
        ap = {"kv_head": kvh, "group": G, "head_dim": hd, "max_seq": S, "window": window, "scale": scale}
        ains = [q, kc, vc, io["pos"]]

        def folded(ins: list[int], outs: list[int], params: dict, last: bool) -> tuple[list[int], list[int], dict]:
            if not fold:
                return ins, outs, params
            ins = [q_raw] + ins[1:] + [qkn["q"], io["inv_freq"]] + ([k_raw, qkn["k"]] if last else [])
            return ins, outs + ([kc] if last else []), {**params, "qk_norm": 1, "append_k": int(last),
                                                        "qk_eps": c.rms_eps}
        if splits == 1 and not by_group:
            b.task("ATTN_DECODE", *folded(ains, [attn], ap, True), [c_qk], c_attn, f"L{l}.attn[g{kvh}]")
            return None
        # fused merge: every partial signals the layer's attention counter; o_proj waits for all of them (by
        # group: its own group's)
        c_part = b.counter(f"attn_part{l}.g{kvh}") if by_group or not merge else c_attn
        if by_group:
            c_groups.append(c_part)
        for sp in range(splits):
            b.task("ATTN_PARTIAL", *folded(ains, [partial], {**ap, "split": sp, "n_splits": splits}, sp == splits - 1),
                   [c_qk], c_part, f"L{l}.attn[g{kvh}.s{sp}]")
        return None if merge or by_group else c_part

    def _merge(kvh: int, c_part: int | None) -> None:
        if c_part is not None:
            b.task("ATTN_MERGE", [partial], [attn], {"kv_head": kvh, "group": G, "head_dim": hd, "n_splits": splits},
                   [c_part], c_attn, f"L{l}.attn_merge[g{kvh}]")

    # 'list_idle' sees every group's QKV tasks placed before attention and every partial before the merges, so
    # attention lands on the SMs the QKV phase leaves idle (and loads its KV history there before its wait); 'list'
    # keeps the measured interleaved order
    c_qks = []   # per KV group: the counter its attention waits on
    c_groups: list[int] = []   # by group: per KV group, the counter its partials signal
    # one counter for every QKV task (by group: every QKV read of x precedes every o_proj add into it)
    c_layer = b.counter(f"qkv{l}") if cfg.attn_wait == "layer" or by_group else None
    qkv_first = qkv_first or c_layer is not None   # attention then waits for every group's QKV tasks
    for kvh in range(nkv):
        c_qkv = c_layer if c_layer is not None else b.counter(f"qkv{l}.g{kvh}")
        jobs = [(QKV_MODE_RAW if raw else QKV_MODE_Q, "q", wq, q_raw if raw else q, h0, hn, c.n_heads)
                for h0, hn in ((kvh * G + s, n) for s, n in tiles(G, cfg.qkv_heads))]
        jobs += [(QKV_MODE_RAW, "k", wk, k_raw, kvh, 1, nkv) if raw else (QKV_MODE_K, "k", wk, kc, kvh, 1, nkv),
                 (QKV_MODE_V, "v", wv, vc, kvh, 1, nkv)]
        for mode, m, w, dst, h0, hn, nh in jobs:
            ins = [xin, w, io["pos"], io["inv_freq"]]
            ins += ([nw] if nw is not None else []) + ([bias[m]] if bias else [])
            has_qkn = bool(qkn) and m != "v" and not raw
            ins += [qkn[m]] if has_qkn else []
            for ps, pc in (tiles(hd // 2, hd // 2 // hs) if hs > 1 else [(0, 0)]):
                b.task("QKV_ROPE", ins, [dst],
                       {"mode": mode, "head_start": h0, "head_count": hn, "head_dim": hd, "k": H, "n_heads": nh,
                        "max_seq": S, "has_norm": int(nw is not None), "has_bias": int(bool(bias)),
                        "has_qknorm": int(has_qkn), "pair_start": ps, "pair_count": pc, "eps": c.rms_eps,
                        "qk_eps": c.rms_eps},
                       [cin], c_qkv, f"L{l}.{m}[{h0}:{h0 + hn}]" + (f".p{ps}" if pc else ""))
        if raw and not fold:   # attention then waits for the finished q and K row (V: through c_qkv -> c_qk)
            c_qk = b.counter(f"qk{l}.g{kvh}")
            b.task("QK_NORM_ROPE", [q_raw, k_raw, io["pos"], io["inv_freq"], qkn["q"], qkn["k"]], [q, kc],
                   {"kv_head": kvh, "group": G, "head_dim": hd, "max_seq": S, "eps": c.rms_eps}, [c_qkv], c_qk,
                   f"L{l}.qk_norm[g{kvh}]")
        else:
            c_qk = c_qkv
        c_qks.append(c_qk)
        if not qkv_first:
            _merge(kvh, _attention(kvh, c_qk))
    if qkv_first:   # every group's QKV tasks, then every attention task, then the merges
        for kvh, c_part in enumerate([_attention(kvh, c_qk) for kvh, c_qk in enumerate(c_qks)]):
            _merge(kvh, c_part)
    wg = b.weight(p + "mlp.gate_proj.weight", (c.intermediate, H))
    wu = b.weight(p + "mlp.up_proj.weight", (c.intermediate, H))
    mlp_rows = rows_for(cfg.mlp_rows, c.intermediate, b.sms, b.warps)
    # the gate/up tiles' heads into L2 while the latency-bound attention hops run -- on the SMs attention leaves idle
    if cfg.mlp_prefetch_kb and nkv * splits <= b.sms // 2:
        trigger = {"layer": cin, "qkv": c_qks[-1],   # the last group's q and K
                   "attn": c_groups[-1] if by_group else c_attn}[cfg.mlp_prefetch_at]
        mlp_tiles = list(_row_tiles(b, c.intermediate, mlp_rows))
        owners = len(mlp_tiles)
        if cfg.mlp_prefetch_spread and cfg.mlp_prefetch_from == "gate":
            n_merge = nkv if splits > 1 and not merge and not by_group else 0   # ATTN_MERGE tasks of the layer
            owners = prefetch_owners(b.sms, qkv_tasks_per_layer(c, cfg.qkv_heads, hs), nkv * splits, n_merge,
                                     len(mlp_tiles))
        mlp_prefetch(b, cfg, l, wg, wu, H, mlp_tiles, trigger, owners)
    xnext, c_next = b.act(f"x{l + 1}", H), b.counter(f"x{l + 1}")
    if by_group:   # x += W_o . attn, one column block per KV group: x is this layer's xmid from here on
        xmid, c_mid = x, b.counter(f"xmid{l}")
        _o_proj_by_group(b, c, p + "self_attn.o_proj.weight", partial, x, splits, c_groups, c_mid, l)
    else:   # fuse_down: o_proj's tiles also seed x_{l+1} = xmid, which the MLP tiles then add their down share to
        xmid, c_mid = b.act(f"xmid{l}", H), b.counter(f"xmid{l}")
        wo = b.weight(p + "self_attn.o_proj.weight", (H, c.n_heads * hd))
        _residual_gemv(b, cfg, partial if merge else attn, wo, x, xmid, H, c.n_heads * hd, c_attn, c_mid,
                       f"L{l}.o_proj", merge=merge, copy=xnext if fuse_down else None)
    xin2, cin2, nw2 = _norm_input(b, cfg, xmid, c_mid, p + "post_attention_layernorm.weight", c, f"xn_mlp{l}")
    norm = [nw2] if nw2 is not None else []
    gp = {"k": H, "n": c.intermediate, "has_norm": int(nw2 is not None), "eps": c.rms_eps}
    if fuse_down:   # each MLP tile adds W_down[:, its rows] . h into x_{l+1}: no h buffer, no down hop
        for r0, rn in _row_tiles(b, c.intermediate, mlp_rows):
            wdb = b.weight(p + "mlp.down_proj.weight", (H, rn), cols=(r0, rn))
            b.task("GEMV_SILU_MUL_DOWN", [xin2, wg, wu, wdb] + norm, [xnext],
                   {"row_start": r0, "row_count": rn, "out_n": H, **gp}, [cin2], c_next, f"L{l}.mlp[{r0}:{r0 + rn}]")
        return xnext, c_next
    h, c_h = b.act(f"h{l}", c.intermediate), b.counter(f"h{l}")
    if cfg.dyn_mlp_rows:   # one claim group on every SM: its own rows to each member, the rest to who asks first
        dr, S = cfg.dyn_mlp_rows, dyn_static_rows(c.intermediate, b.sms, cfg.dyn_mlp_rows, cfg.dyn_mlp_static)
        n_mem = min(b.sms, -(-c.intermediate // S))
        claim = b.counter(f"claim_gate_up{l}")
        for j in range(n_mem):
            b.task("GEMV_SILU_MUL", [xin2, wg, wu] + norm, [h],
                   {"row_start": 0, "row_count": c.intermediate, **gp, "dyn_rows": dr, "dyn_index": j,
                    "dyn_tasks": n_mem, "dyn_claim": claim, "dyn_static": S}, [cin2], c_h,
                   f"L{l}.gate_up[dyn {j}/{n_mem}]")
    else:
        for r0, rn in _row_tiles(b, c.intermediate, mlp_rows):
            b.task("GEMV_SILU_MUL", [xin2, wg, wu] + norm, [h], {"row_start": r0, "row_count": rn, **gp}, [cin2],
                   c_h, f"L{l}.gate_up[{r0}:{r0 + rn}]")
    wd = b.weight(p + "mlp.down_proj.weight", (H, c.intermediate))
    _residual_gemv(b, cfg, h, wd, xmid, xnext, H, c.intermediate, c_h, c_next, f"L{l}.down")
    return xnext, c_next


def _o_proj_by_group(b: _Builder, c, key: str, partial: int, x: int, splits: int, c_groups: list[int], c_mid: int,
                     l: int) -> None:
    """o_proj split-K by KV group (knob o_proj_by_group): for group g, x[rows] += W_o[rows, g's G*hd columns] .
    merge(g's split-KV partials), atomically, waiting only on g's partials. Row tiles: as many tasks over all
    groups as fit one wave of SMs (warp multiples). W_o's column block of each group is its own contiguous
    [hidden, G*hd] weight buffer (Buffer.cols), so a tile's weights are one contiguous range (prefetchable)."""
    H, G, hd, nkv = c.hidden, c.group, c.head_dim, c.n_kv_heads
    kg = G * hd
    rows = auto_rows(H * nkv, b.sms, b.warps)
    for g in range(nkv):
        wg = b.weight(key, (H, kg), cols=(g * kg, kg))
        for r0, rn in _row_tiles(b, H, rows):
            b.task("GEMV", [partial, wg], [x],
                   {"row_start": r0, "row_count": rn, "k": kg, "n": H, "has_norm": 0, "has_bias": 0,
                    "has_residual": 0, "x_splits": splits, "x_group": G, "x_head_dim": hd,
                    "x_start": g * splits * G * (hd + 2), "accumulate": 1},
                   [c_groups[g]], c_mid, f"L{l}.o_proj[g{g}][{r0}:{r0 + rn}]")


def step_io(b: _Builder, s: int, vocab: int) -> dict:
    """The IO buffers of decode step ``s`` of a launch. Step 0: 'token' and 'pos' (IO_INPUT, set by the host or by
    the previous launch's last block), 'logits' and 'next_token'. Step s >= 1: 'pos@s' (IO_INPUT, pos + s: the
    loader lays the positions out as one int32 array, pos@s at element s), 'logits@s' and 'next_token@s' (the
    tokens likewise one array, next_token@s at element s); its token is step s-1's next_token, read on the device."""
    io = {"token": b.buf("token", BufferKind.IO_INPUT, DType.I32, (1,))} if s == 0 else {}
    io.update({"pos": b.buf(step_name("pos", s), BufferKind.IO_INPUT, DType.I32, (1,)),
               "logits": b.buf(step_name("logits", s), BufferKind.IO_OUTPUT, DType.F32, (vocab,)),
               "next_token": b.buf(step_name("next_token", s), BufferKind.IO_OUTPUT, DType.I32, (1,))})
    return io


def _step(b: _Builder, graph: ModelGraph, cfg: ScheduleConfig, io: dict, prev, c_tok: int, S: int, splits: int,
          hs: int, qkv_first: bool) -> None:
    """One decode step: EMBED, the layers, the LM head and the argmax into io['next_token'] (signalling c_tok).
    prev: None for a launch's first step, else (the step before's next_token buffer, its counter): the EMBED then
    waits on it and reads the token on the device (live_token)."""
    c = graph.config
    emb = b.weight("model.embed_tokens.weight", (c.vocab, c.hidden))
    x, cx = b.act("x0", c.hidden), b.counter("x0")
    tok, waits = (io["token"], []) if prev is None else (prev[0], [prev[1]])
    b.task("EMBED", [emb, tok], [x], {"col_start": 0, "col_count": c.hidden, "vocab": c.vocab, "hidden": c.hidden,
                                      "live_token": int(prev is not None)}, waits, cx, "embed")
    for l in range(c.n_layers):
        x, cx = _layer(b, graph, cfg, l, x, cx, io, S, splits, hs, qkv_first)
    xin, cin, nw = _norm_input(b, cfg, x, cx, "model.norm.weight", c, "xn_final")
    lm = b.weight(lm_head_key(c), (c.vocab, c.hidden))
    lm_tiles = (list(_row_tiles(b, c.vocab, cfg.lm_head_rows or LM_HEAD_AUTO_ROWS)) if b.balance_sms   # balance_tiles
                else lm_head_tiles(c.vocab, cfg.lm_head_rows, b.sms))
    # split_argmax: each tile signals its own counter and one ARGMAX_PARTIAL per tile picks the tile's winner
    # (emitted after every tile, so a partial queues behind the tiles of its SM); ARGMAX_MERGE picks among them.
    # argmax_in_lm_head (with split_argmax): each tile writes its own (max, index) pair (GEMV has_argmax) and
    # signals one counter, which ARGMAX_PAIRS waits on: no partial tasks, one round trip in the merge
    in_tile = cfg.split_argmax and cfg.argmax_in_lm_head
    per_tile = cfg.split_argmax and not in_tile   # a counter per tile (its ARGMAX_PARTIAL waits on it), else one
    pairs = b.act("argmax_pairs", 2 * len(lm_tiles)) if in_tile else None
    c_log = ([b.counter(f"logits[{r0}:{r0 + rn}]") for r0, rn in lm_tiles] if per_tile else
             [b.counter("argmax_pairs" if in_tile else "logits")])
    for k, (r0, rn) in enumerate(lm_tiles):
        ins = [xin, lm] + ([nw] if nw is not None else [])
        prm = {"row_start": r0, "row_count": rn, "k": c.hidden, "n": c.vocab, "has_norm": int(nw is not None),
               "has_bias": 0, "has_residual": 0, "eps": c.rms_eps}
        if in_tile:
            prm.update(has_argmax=1, argmax_slot=k)
        b.task("GEMV", ins, [io["logits"]] + ([pairs] if in_tile else []), prm, [cin],
               c_log[k if per_tile else 0], f"lm_head[{r0}:{r0 + rn}]")
    if in_tile:
        b.task("ARGMAX_PAIRS", [pairs], [io["next_token"]], {"n_cand": len(lm_tiles)}, [c_log[0]], c_tok, "argmax")
    elif cfg.split_argmax:
        cand, c_cand = b.buf("argmax_cand", BufferKind.ACTIVATION, DType.I32, (len(lm_tiles),)), b.counter("argmax_cand")
        for k, (r0, rn) in enumerate(lm_tiles):
            b.task("ARGMAX_PARTIAL", [io["logits"]], [cand], {"start": r0, "count": rn, "slot": k}, [c_log[k]], c_cand,
                   f"argmax_part[{r0}:{r0 + rn}]")
        b.task("ARGMAX_MERGE", [io["logits"], cand], [io["next_token"]], {"n": c.vocab, "n_cand": len(lm_tiles)},
               [c_cand], c_tok, "argmax")
    else:
        b.task("ARGMAX", [io["logits"]], [io["next_token"]], {"n": c.vocab}, c_log, c_tok, "argmax")


def lower(graph: ModelGraph, target: GpuTarget, config: ScheduleConfig | dict | None = None,
          max_seq: int | None = None) -> MegakernelProgram:
    """Lower ``config.steps_per_launch`` greedy decode steps (one launch; usually 1) of ``graph`` for ``target``."""
    t0 = time.perf_counter()
    cfg = config if isinstance(config, ScheduleConfig) else ScheduleConfig.from_dict(config or {})
    errs = cfg.check_target(target)
    if errs:
        raise IRError("config does not fit the target: " + "; ".join(errs))
    c = graph.config
    S = int(max_seq or min(c.max_position, DEFAULT_MAX_SEQ))
    if not 1 <= S <= c.max_position:
        raise IRError(f"max_seq {S} outside [1, {c.max_position}] for this model")
    if c.head_dim % 2 or c.n_heads % c.n_kv_heads:
        raise IRError(f"unsupported head layout: head_dim {c.head_dim}, heads {c.n_heads}/{c.n_kv_heads}")
    n_sms = cfg.sms_for(target)
    b = _Builder(DType(graph.dtype), n_sms, cfg.balance_tiles, cfg.threads_per_block // 32, target.smem_per_block)
    hs = qkv_split_for(cfg.qkv_head_split, cfg.qkv_heads, c.n_heads, c.n_kv_heads, c.head_dim, n_sms,
                       qkv_reserve(cfg, c.n_kv_heads, S))  # QKV tasks per head
    # SMs a layer's QKV phase leaves idle: where auto placement puts attention (then it loads its KV early)
    idle = n_sms - qkv_tasks_per_layer(c, cfg.qkv_heads, hs) if cfg.sm_assignment in IDLE_POLICIES else 0
    # the largest QKV task's weight bytes (a pair slice of one head, or qkv_heads whole heads)
    qkv_rows = c.head_dim // hs if hs > 1 else cfg.qkv_heads * c.head_dim
    splits = attn_splits_for(cfg.attn_splits, c.n_kv_heads, S, n_sms, idle,
                             qkv_rows * c.hidden * DType(graph.dtype).nbytes)
    policy = assignment_for(cfg.sm_assignment, c.n_kv_heads, splits, idle)
    inv_freq = None   # the RoPE frequencies (CONST)
    prev = None   # (the step before's next_token buffer, the counter its argmax signals)
    for s in range(cfg.steps_per_launch):
        b.step = s
        io = step_io(b, s, c.vocab)
        if inv_freq is None:   # made after step 0's IO: a one-step program's buffers keep their order
            inv_freq = b.buf("inv_freq", BufferKind.CONST, DType.F32, (c.head_dim // 2,),
                             data=[float(v) for v in rope_inv_freq(c)])
        io["inv_freq"] = inv_freq
        c_tok = b.counter("next_token") if s + 1 < cfg.steps_per_launch else -1   # the next step's EMBED waits
        _step(b, graph, cfg, io, prev, c_tok, S, splits, hs, policy == "list_idle")
        prev = (io["next_token"], c_tok)
    b.step = 0
    b.finalize_thresholds()
    if cfg.flag_hops != "off":   # (checked below, once the program is placed)
        apply_flag_hops(b.buffers, b.tasks, cfg.flag_hops)

    numel = lambda i: b.buffers[i].numel  # noqa: E731
    isz = lambda i: b.buffers[i].dtype.nbytes if b.buffers[i].kind != BufferKind.ACTIVATION else 4  # noqa: E731
    for t in b.tasks:
        t.est_bytes, t.est_flops = estimate(t, numel, isz)
    queues = _assign(b.tasks, n_sms, policy, target.hbm_gbps * 1e9 / n_sms, cfg.early_kv, cfg.steps_per_launch,
                     cfg.step_placement)
    cfg_d = cfg.to_dict()
    kv_per_tok = 2 * c.n_layers * c.n_kv_heads * c.head_dim * DType(graph.dtype).nbytes
    meta = {"model": graph.name, "arch": c.arch, "dtype": graph.dtype, "max_seq": S, "vocab": c.vocab,
            "hidden": c.hidden, "n_layers": c.n_layers, "kv_bytes_per_token": kv_per_tok,
            "attn_splits": splits, "steps_per_launch": cfg.steps_per_launch,
            "schedule_id": schedule_id(cfg_d), "lower_seconds": round(time.perf_counter() - t0, 3)}
    prog = MegakernelProgram(meta, target, b.buffers, b.counters, b.tasks, queues, cfg_d)
    if cfg.flag_hops != "off":
        check_flag_hops(prog)
    return prog


def schedule_id(config: dict) -> str:
    """A short stable id of a config (what the flywheel logs)."""
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
