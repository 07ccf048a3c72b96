"""Per-task checks of the validator (``schedule/validate.py``): opcode, arity, params and ABI caps, access ranges,
and the buffer shapes each opcode relies on. A mixin of ``_Validator``: it uses ``self.p`` (the program),
``self.err(kind, msg)`` and the ``self.T / self.B`` namers defined there.
"""
from __future__ import annotations

import math

from schedule import ops
from schedule.ir import BufferKind, DType, Task, Wait
from vm.abi import MAX_BUFS, MAX_WAITS, OPCODES, QKV_MODE_K, QKV_MODE_RAW, QKV_MODE_V

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
READ_ONLY_KINDS = (BufferKind.WEIGHT, BufferKind.CONST, BufferKind.IO_INPUT)
MAX_PAIR_INDEX = 1 << 24   # GEMV has_argmax stores a row index as fp32: exact below 2^24
MAX_PREFETCH_DELAY_NS = 100_000   # an L2_PREFETCH task's delay_ns (its SM sleeps without polling the abort flag)
# iparams that may be omitted (packed as 0): the optional-input flags, the sliding window and scheduling hints.
DEFAULTED_IPARAMS = ({"window", "pair_start", "pair_count", "x_splits", "x_group", "x_head_dim", "x_start", "accumulate",
                      "early_kv", "delay_ns", "argmax_slot", "dyn_rows", "dyn_index", "dyn_tasks", "dyn_claim",
                      "dyn_static"}
                     | {flag for spec in OPCODES.values() for _, flag in spec.optional_inputs + spec.optional_outputs})
# fparams needed only when a flag is set.
CONDITIONAL_FPARAMS = {("GEMV", "eps"): "has_norm", ("GEMV_SILU_MUL", "eps"): "has_norm",
                       ("GEMV_SILU_MUL_DOWN", "eps"): "has_norm",
                       ("QKV_ROPE", "eps"): "has_norm", ("QKV_ROPE", "qk_eps"): "has_qknorm",
                       ("ATTN_DECODE", "qk_eps"): "qk_norm", ("ATTN_PARTIAL", "qk_eps"): "qk_norm"}


def _is_int(x) -> bool:
    return type(x) is int


class _Lazy:
    """A task's display name, formatted only when an error message is built."""
    __slots__ = ("v", "i")

    def __init__(self, v, i):
        self.v, self.i = v, i

    def __format__(self, spec: str) -> str:
        return self.v.T(self.i)


class TaskChecks:
    """Checks of one task at a time (no graph needed)."""

    def _check_flag_slots(self) -> None:
        """A flagged buffer only where the kernel reads / writes the flagged layout (vm.abi.FLAG_SLOTS, with the
        params that must be 0 there), and a data wait only in a task that reads some flagged buffer."""
        from vm.abi import FLAG_SLOTS
        p = self.p
        self.flagged = {i for i, b in enumerate(p.buffers) if getattr(b, "flagged", False)}
        for i, t in enumerate(p.tasks):
            reads_flag = False
            for a in self.acc.get(i, ()):
                if a.buffer not in self.flagged:
                    continue
                reads_flag = reads_flag or not a.write
                need = FLAG_SLOTS.get(t.op, {}).get(a.slot)
                if need is None:
                    self.err("flag", f"{self.T(i)}: slot '{a.slot}' is {self.B(a.buffer)}, which is data-flagged; "
                                     f"the kernel's {t.op} reads / writes plain fp32 there (flagged slots: "
                                     f"{', '.join(f'{o}.{s}' for o, d in FLAG_SLOTS.items() for s in d)})")
                for k in need or ():
                    if int(t.params.get(k, 0)):
                        self.err("flag", f"{self.T(i)}: slot '{a.slot}' is the data-flagged {self.B(a.buffer)}, "
                                         f"which the kernel supports only with {k} = 0 (got {t.params.get(k)})")
            if not reads_flag and any(getattr(w, "data", False) for w in t.waits):
                self.err("flag", f"{self.T(i)} has a data wait (Wait.data) but reads no data-flagged buffer: nothing "
                                 f"would make it wait")

    def _check_task(self, i: int) -> bool:
        """Per-task checks; True if the task's references are sound enough for the graph and race analysis."""
        t = self.p.tasks[i]
        if not isinstance(t, Task):
            self.err("task", f"task {i}: not a Task ({type(t).__name__})")
            return False
        if t.id != i:
            self.err("task", f"task {i}: id {t.id!r} != its position {i}")
        if not isinstance(t.op, str) or t.op not in OPCODES:
            self.err("opcode", f"task {i}: unknown opcode {t.op!r} (known: {', '.join(OPCODES)})")
            return False
        name, spec, ok = _Lazy(self, i), OPCODES[t.op], True
        nb, nc = len(self.p.buffers), len(self.p.counters)
        if not isinstance(t.params, dict) or not all(isinstance(k, str) for k in t.params):
            self.err("params", f"{name}: params must be a dict with string keys")
            return False
        # params: presence, type, int32 range
        for pn in spec.iparams:
            v = t.params.get(pn)
            if v is None and pn not in DEFAULTED_IPARAMS:
                self.err("params", f"{name}: missing int param '{pn}'")
            elif v is not None and (not isinstance(v, int) or not INT32_MIN <= v <= INT32_MAX):
                self.err("params", f"{name}: int param '{pn}' = {v!r} is not an int32")
            else:
                continue
            ok = False
        for pn in spec.fparams:
            v = t.params.get(pn)
            flag = CONDITIONAL_FPARAMS.get((t.op, pn))
            needed = flag is None or (isinstance(t.params.get(flag), int) and t.params.get(flag))
            if v is None and needed:
                self.err("params", f"{name}: missing float param '{pn}'")
            elif v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                    or abs(v) > 3.4e38):
                self.err("params", f"{name}: float param '{pn}' = {v!r} is not a finite float32")
            else:
                continue
            ok = False
        unknown = set(t.params) - set(spec.iparams) - set(spec.fparams)
        if unknown:
            self.warnings.append(f"{name}: unknown param(s) {sorted(unknown)} are ignored by the VM")
        if not ok:
            return False
        # buffers: types, range, arity, caps, writable outputs
        for field in ("inputs", "outputs"):
            ids = getattr(t, field)
            if not isinstance(ids, list) or not all(_is_int(b) for b in ids):
                self.err("refs", f"{name}: {field} must be a list of buffer ids")
                return False
            for b in ids:
                if not 0 <= b < nb:
                    self.err("refs", f"{name}: {field[:-1]} buffer id {b} out of range [0, {nb})")
                    ok = False
                elif self.numel.get(b) is None:
                    ok = False  # the buffer itself is broken (reported there)
        slots = spec.input_slots(t.params)
        if len(t.inputs) != len(slots):
            self.err("arity", f"{name}: {len(t.inputs)} inputs, opcode {t.op} with these flags takes "
                              f"{len(slots)} ({', '.join(slots)})")
            ok = False
        out_slots = spec.output_slots(t.params)
        if len(t.outputs) != len(out_slots):
            self.err("arity", f"{name}: {len(t.outputs)} outputs, opcode {t.op} with these flags takes "
                              f"{len(out_slots)} ({', '.join(out_slots)})")
            ok = False
        if len(t.inputs) + len(t.outputs) > MAX_BUFS:
            self.err("abi", f"{name}: {len(t.inputs) + len(t.outputs)} buffers exceed the ABI cap {MAX_BUFS}")
            ok = False
        if ok:
            for b in t.outputs:
                if self.kinds[b] in READ_ONLY_KINDS:
                    self.err("readonly", f"{name}: writes {self.B(b)}, which is read-only")
                    ok = False
        # counters and waits
        if not _is_int(t.out_counter) or not -1 <= t.out_counter < nc:
            self.err("refs", f"{name}: out_counter {t.out_counter!r} out of range [-1, {nc})")
            ok = False
        if not isinstance(t.waits, list) or not all(isinstance(w, Wait) for w in t.waits):
            self.err("refs", f"{name}: waits must be a list of Wait")
            return False
        if len(t.waits) > MAX_WAITS:
            self.err("abi", f"{name}: {len(t.waits)} waits exceed the ABI cap {MAX_WAITS}")
            ok = False
        for w in t.waits:
            if not _is_int(w.counter) or not 0 <= w.counter < nc:
                self.err("refs", f"{name}: waits on counter {w.counter!r} out of range [0, {nc})")
                ok = False
            elif not _is_int(w.threshold) or not 1 <= w.threshold <= INT32_MAX:
                self.err("threshold", f"{name}: wait on {self.C(w.counter)} has threshold {w.threshold!r}; "
                                      f"it must be an int32 >= 1 (the producer count)")
                ok = False
        if not _is_int(t.sm):
            self.err("refs", f"{name}: sm {t.sm!r} is not an integer")
            ok = False
        return ok and self._check_ranges(i, t, slots)

    def _check_ranges(self, i: int, t: Task, slots: list[str]) -> bool:
        name, n = _Lazy(self, i), self.numel
        try:
            acc = ops.accesses(t, lambda b: n[b])
        except Exception as e:  # noqa: BLE001
            self.err("params", f"{name}: cannot derive its buffer accesses: {type(e).__name__}: {e}")
            return False
        ok = True
        for a in acc:
            if not 0 <= a.lo < a.hi <= n[a.buffer]:
                self.err("range", f"{name}: slot '{a.slot}' {'writes' if a.write else 'reads'} elements "
                                  f"[{a.lo}, {a.hi}) of {self.B(a.buffer)}, outside its {n[a.buffer]} elements"
                                  + (" (empty range)" if a.lo >= a.hi else ""))
                ok = False
        ok = self._check_shapes(i, t, slots) and ok
        if ok:
            self.acc[i] = acc
        return ok

    def _partial_splits(self) -> dict[int, set[int]]:
        """{partial buffer id: the n_splits values of the ATTN_PARTIAL tasks writing it} (computed once)."""
        if getattr(self, "_psplits", None) is None:
            self._psplits: dict[int, set[int]] = {}
            for t in self.p.tasks:
                if isinstance(t, Task) and t.op == "ATTN_PARTIAL" and len(t.outputs) == 1 and isinstance(t.params, dict):
                    self._psplits.setdefault(t.outputs[0], set()).add(t.params.get("n_splits"))
        return self._psplits

    def _check_attn_qk_norm(self, op: str, P: dict, s: dict, numel, need) -> None:
        """An attention task's folded QK-norm (qk_norm / append_k): its q slot holds RAW rows, and exactly the task
        whose keys end at pos (ATTN_DECODE, or the last split: the kernel's split bounds always give it pos) finishes
        the new K row into the k_cache buffer -- any other choice would read a K row nobody wrote."""
        qkn, appk = int(P.get("qk_norm", 0)), int(P.get("append_k", 0))
        need(qkn in (0, 1) and appk in (0, 1), "qk_norm / append_k must be 0 or 1")
        if not qkn:
            need(not appk, "append_k (finish the new K row) needs qk_norm")
            return
        g, G, hd = P["kv_head"], P["group"], P["head_dim"]
        last = op == "ATTN_DECODE" or P["split"] == P["n_splits"] - 1
        need(bool(appk) == last, f"with qk_norm, append_k must be 1 exactly on the task whose keys end at pos (the "
                                 f"last split, or ATTN_DECODE): split {P.get('split', 0)} of {P.get('n_splits', 1)}"
                                 f" has append_k {appk}")
        need(hd >= 2 and hd % 2 == 0, f"head_dim {hd} must be even for RoPE")
        need(self.kinds[s["q"]] == BufferKind.ACTIVATION, "with qk_norm, q must be the RAW q rows (an ACTIVATION)")
        need(numel("q_norm_w") == hd and numel("inv_freq") == hd // 2, "q_norm_w size != head_dim or inv_freq size "
                                                                       "!= head_dim/2")
        if appk:
            need(s.get("k_out") == s["k_cache"], "k_out must be the task's k_cache buffer")
            need(self.kinds[s["k_raw"]] == BufferKind.ACTIVATION and numel("k_raw") >= (g + 1) * hd,
                 f"k_raw must be an ACTIVATION of at least (kv_head+1)*head_dim = {(g + 1) * hd} elements")
            need(numel("k_norm_w") == hd, "k_norm_w size != head_dim")

    def _check_shapes(self, i: int, t: Task, slots: list[str]) -> bool:
        """What each op assumes about its buffers beyond bounds (the reference VM reshapes by these)."""
        P, s = t.params, dict(zip(slots + OPCODES[t.op].output_slots(t.params), t.inputs + t.outputs))
        shape = lambda slot: tuple(self.p.buffers[s[slot]].shape)  # noqa: E731
        numel = lambda slot: self.numel[s[slot]]  # noqa: E731
        bad: list[str] = []

        def need(cond: bool, msg: str) -> None:
            if not cond:
                bad.append(msg)
        op = t.op
        if op == "EMBED":
            need(P["col_start"] >= 0 and P["col_count"] >= 1 and P["col_start"] + P["col_count"] <= P["hidden"],
                 "columns outside [0, hidden)")
            need(shape("table") == (P["vocab"], P["hidden"]), f"table shape {shape('table')} != (vocab, hidden)")
            tb = self.p.buffers[s["token"]]
            need(tb.dtype == DType.I32, f"token buffer '{tb.name}' is {tb.dtype.value}, not i32")
            need(P["live_token"] in (0, 1), f"live_token {P['live_token']} is not 0 or 1")
            if P["live_token"]:   # read after the wait: the step before's argmax output
                need(tb.kind in (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT),
                     f"live_token 1 reads the token after the wait, from an activation or IO output written in the "
                     f"launch; '{tb.name}' is {tb.kind.value}")
            else:   # the kernel takes an IO_INPUT's value before the wait (and the launch's token from its params)
                need(tb.kind == BufferKind.IO_INPUT, f"live_token 0 takes the token before the wait, from an "
                                                     f"IO_INPUT buffer; '{tb.name}' is {tb.kind.value}")
        elif op == "RMSNORM":
            need(P["n"] == numel("x") == numel("w") == numel("y"), "n, x, w and y sizes differ")
        elif op in ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN"):
            r0, rn, K, N = P["row_start"], P["row_count"], P["k"], P["n"]
            need(r0 >= 0 and rn >= 1 and r0 + rn <= N, f"rows [{r0}, {r0 + rn}) outside [0, n={N})")
            xsp, xg, xd, x0 = (int(P.get(k, 0)) for k in ("x_splits", "x_group", "x_head_dim", "x_start"))
            if xsp > 0:   # x = split-KV attention partials [k / (G*hd), x_splits, G, hd + 2], merged while staged
                need(xg >= 1 and xd >= 1 and K % (xg * xd) == 0,
                     f"x_group {xg} x x_head_dim {xd} must be >= 1 and divide k={K}")
                if xg >= 1 and xd >= 1:
                    want, blk = ops.gemv_x_elems(P), xsp * xg * (xd + 2)
                    need(x0 >= 0 and x0 % blk == 0 and numel("x") % blk == 0 and x0 + want <= numel("x"),
                         f"merged x: elements [{x0}, {x0 + want}) (x_start, then k / (x_group*x_head_dim) KV groups"
                         f" of x_splits * x_group * (x_head_dim+2) = {blk}) must be whole groups of the partial "
                         f"buffer of {numel('x')} elements")
                ns_w = self._partial_splits().get(s["x"], {xsp})
                need(ns_w == {xsp}, f"merged x: partial buffer of {numel('x')} elements written by ATTN_PARTIAL "
                                    f"tasks with n_splits {sorted(ns_w)}, not x_splits {xsp}")
                need("norm_w" not in s, "x_splits with has_norm: a merged input cannot be RMS-normalised")
            else:
                need(xsp == 0 and xg == 0 and xd == 0,
                     f"x_splits {xsp} must be >= 0 (x_group / x_head_dim only with it)")
                need(x0 == 0 and K == numel("x"), f"k={K} != x size {numel('x')} (x_start {x0} only with x_splits)")
            f32_act = lambda slot: (self.kinds[s[slot]] == BufferKind.ACTIVATION  # noqa: E731
                                    and self.p.buffers[s[slot]].dtype == DType.F32)
            if op == "GEMV":
                acc = P.get("accumulate", 0)
                need(acc in (0, 1), f"accumulate {acc} must be 0 or 1")
                need(not acc or f32_act("y"), "accumulate adds atomically into fp32: y must be an f32 ACTIVATION buffer")
                if "y_copy" in s:
                    need(not acc, "has_copy with accumulate: the copy of a partial sum is not the row's value")
                    need(f32_act("y_copy"), "y_copy must be an f32 ACTIVATION buffer (the kernel writes fp32 rows)")
                ha = P.get("has_argmax", 0)
                need(ha in (0, 1), f"has_argmax {ha} must be 0 or 1")
                if "pairs" in s:
                    need(not acc and xsp == 0, "has_argmax needs the rows' final values: not with accumulate or "
                                               "x_splits")
                    need(f32_act("pairs"), "pairs must be an f32 ACTIVATION buffer ((value, index) as fp32)")
                    need(P.get("argmax_slot", -1) >= 0, f"has_argmax needs argmax_slot >= 0, got {P.get('argmax_slot')}")
                    need(r0 + rn <= MAX_PAIR_INDEX, f"rows up to {r0 + rn}: a pair's index is exact in fp32 only "
                                                    f"below {MAX_PAIR_INDEX}")
            if op == "GEMV_SILU_MUL":   # a claim-group member (vm/abi.py): its chunking and its ticket counter
                dr, dj, dn, dc, ds = (int(P.get(k, 0)) for k in ("dyn_rows", "dyn_index", "dyn_tasks", "dyn_claim",
                                                                  "dyn_static"))
                if dr > 0:
                    need(dn >= 1 and 0 <= dj < dn, f"dyn_index {dj} outside [0, dyn_tasks={dn})")
                    need(ds >= 0 and dn * max(ds, dr) <= INT32_MAX, f"dyn_static {ds} must be >= 0 (and N*S an int32)")
                    need(0 <= dc < len(self.p.counters), f"dyn_claim {dc} is not a counter id")
                    need(self.kinds[s["h"]] == BufferKind.ACTIVATION and s["h"] not in t.inputs,
                         "a claim group writes h: it must be an ACTIVATION buffer the task does not read")
                else:
                    need(dr == 0 and dj == 0 and dn == 0 and dc == 0 and ds == 0,
                         f"dyn_rows {dr} must be >= 0 (dyn_index / dyn_tasks / dyn_claim / dyn_static only with it)")
            if op == "GEMV_SILU_MUL_DOWN":
                on = P["out_n"]
                need(on >= 1 and shape("w_down") == (on, rn),
                     f"'w_down' shape {shape('w_down')} != (out_n, row_count) = ({on}, {rn}): the tile's column "
                     f"block of down_proj")
                need(f32_act("y"), "y (added into atomically) must be an f32 ACTIVATION buffer")
            for w in ("w", "w_gate", "w_up"):
                if w in s:
                    need(shape(w) == (N, K), f"'{w}' shape {shape(w)} != (n, k) = ({N}, {K})")
            if "norm_w" in s:
                need(numel("norm_w") == K, "norm_w size != k")
        elif op == "QKV_ROPE":
            h0, hn, hd, K, H, S = (P[k] for k in ("head_start", "head_count", "head_dim", "k", "n_heads", "max_seq"))
            need(P["mode"] in (0, 1, 2, 3), f"mode {P['mode']} not Q/K/V/RAW")
            need(hd >= 2 and hd % 2 == 0, f"head_dim {hd} must be even")
            need(h0 >= 0 and hn >= 1 and h0 + hn <= H, f"heads [{h0}, {h0 + hn}) outside [0, n_heads={H})")
            need(K == numel("x"), f"k={K} != x size {numel('x')}")
            need(shape("w") == (H * hd, K), f"w shape {shape('w')} != (n_heads*head_dim, k) = ({H * hd}, {K})")
            need(numel("inv_freq") == hd // 2, "inv_freq size != head_dim/2")
            ps, pc = P.get("pair_start", 0), P.get("pair_count", 0)
            if pc:   # a slice of RoPE pairs (rows ps.. and hd/2+ps..) of one head
                need(0 <= ps and pc >= 1 and ps + pc <= hd // 2,
                     f"RoPE pairs [{ps}, {ps + pc}) outside [0, head_dim/2={hd // 2})")
                need(hn == 1, f"a pair slice covers one head, not head_count={hn}")
                need("qk_norm_w" not in s, "QK-norm needs the whole head: pair_count must be 0 with has_qknorm")
            else:
                need(ps == 0, f"pair_start {ps} without pair_count")
            if "qk_norm_w" in s:
                need(numel("qk_norm_w") == hd, "qk_norm_w size != head_dim")
            if "norm_w" in s:
                need(numel("norm_w") == K, "norm_w size != k")
            if P["mode"] in (QKV_MODE_K, QKV_MODE_V):
                need(self.kinds[s["dst"]] == BufferKind.KV_CACHE and shape("dst") == (H, S, hd),
                     f"K/V dst must be a KV_CACHE of shape (n_heads, max_seq, head_dim) = ({H}, {S}, {hd})")
            if P["mode"] == QKV_MODE_RAW:
                need("qk_norm_w" not in s, "mode RAW writes unnormalised rows: has_qknorm must be 0 (QK_NORM_ROPE "
                                           "applies the QK-norm)")
                need(self.kinds[s["dst"]] == BufferKind.ACTIVATION and numel("dst") == H * hd,
                     f"RAW dst must be an ACTIVATION of n_heads*head_dim = {H * hd} elements")
        elif op == "QK_NORM_ROPE":
            g, G, hd, S = P["kv_head"], P["group"], P["head_dim"], P["max_seq"]
            need(g >= 0 and G >= 1 and hd >= 2 and hd % 2 == 0, "kv_head/group >= 0/1, head_dim even and >= 2")
            shp = shape("k_cache")
            need(self.kinds[s["k_cache"]] == BufferKind.KV_CACHE and len(shp) == 3 and shp[1:] == (S, hd)
                 and g < shp[0], f"'k_cache' must be a KV_CACHE of shape (n_kv > kv_head, max_seq, head_dim) = "
                                 f"(>{g}, {S}, {hd}), got {shp}")
            if len(shp) == 3:
                need(numel("k_raw") == shp[0] * hd, f"k_raw has {numel('k_raw')} elements, want n_kv*head_dim = "
                                                    f"{shp[0] * hd}")
            need(all(self.kinds[s[b]] == BufferKind.ACTIVATION for b in ("q_raw", "k_raw", "q")),
                 "q_raw, k_raw and q must be ACTIVATION buffers (fp32 on the device)")
            need(numel("q_raw") == numel("q") and numel("q") >= (g + 1) * G * hd,
                 f"q_raw / q must have the same size, at least (kv_head+1)*group*head_dim = {(g + 1) * G * hd}")
            need(numel("inv_freq") == hd // 2, "inv_freq size != head_dim/2")
            need(numel("q_norm_w") == hd and numel("k_norm_w") == hd, "q_norm_w / k_norm_w size != head_dim")
        elif op in ("ATTN_DECODE", "ATTN_PARTIAL", "ATTN_MERGE"):
            g, G, hd = P["kv_head"], P["group"], P["head_dim"]
            need(g >= 0 and G >= 1 and hd >= 1, "kv_head/group/head_dim must be >= 0/1/1")
            if op != "ATTN_MERGE":
                S = P["max_seq"]
                need(P.get("window", 0) >= 0, "window must be >= 0")
                need(P.get("early_kv", 0) in (0, 1, 2), "early_kv (issue the KV history before the wait: 1 = the task, "
                     "2 = the task before it in its queue) must be 0, 1 or 2")
                for c in ("k_cache", "v_cache"):
                    shp = shape(c)
                    need(self.kinds[s[c]] == BufferKind.KV_CACHE and len(shp) == 3 and shp[1:] == (S, hd)
                         and g < shp[0], f"'{c}' must be a KV_CACHE of shape (n_kv > kv_head, max_seq, head_dim)"
                                         f" = (>{g}, {S}, {hd}), got {shp}")
            if op != "ATTN_DECODE":
                row = P["n_splits"] * G * (hd + 2)
                need(P["n_splits"] >= 1 and numel("partial") % max(row, 1) == 0,
                     f"n_splits must be >= 1 and the partial buffer a whole number of [n_splits, group, "
                     f"head_dim + 2] blocks ({numel('partial')} elements, block {row})")
            if op == "ATTN_PARTIAL":
                need(0 <= P["split"] < P["n_splits"], f"split {P['split']} outside [0, n_splits)")
            if op != "ATTN_MERGE":
                self._check_attn_qk_norm(op, P, s, numel, need)
        elif op == "ARGMAX":
            need(P["n"] >= 1, "n must be >= 1")
        elif op == "L2_PREFETCH":   # the SM sleeps that long without polling the abort flag: keep it short
            need(0 <= P.get("delay_ns", 0) <= MAX_PREFETCH_DELAY_NS,
                 f"delay_ns {P.get('delay_ns', 0)} outside [0, {MAX_PREFETCH_DELAY_NS}]")
        elif op == "ARGMAX_PAIRS":
            need(P["n_cand"] >= 1, f"n_cand {P['n_cand']} must be >= 1")
            need(self.p.buffers[s["pairs"]].dtype == DType.F32 and self.p.buffers[s["token"]].dtype == DType.I32,
                 "pairs must be f32 and token i32")
        elif op in ("ARGMAX_PARTIAL", "ARGMAX_MERGE"):   # the kernel reads fp32 logits, writes int32 indices
            dt = lambda slot: self.p.buffers[s[slot]].dtype  # noqa: E731
            need(dt("logits") == DType.F32 and dt("cand") == DType.I32,
                 f"logits must be f32 and cand i32, got {dt('logits').value} / {dt('cand').value}")
            if op == "ARGMAX_MERGE":
                need(P["n_cand"] <= P["n"], f"n_cand {P['n_cand']} > n {P['n']}: more candidates than logits")
        for m in bad:
            self.err("shape", f"{self.T(i)}: {m}")
        return not bad
