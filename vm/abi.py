"""The VM's ABI: opcodes, their buffer/param slots, and the POD structs -- the one source of truth.

Everything that both Python and CUDA must agree on is defined here, once:

* ``OPCODES``: every opcode's number, its buffer slots (inputs then outputs, optional ones named) and its
  integer / float parameter names. Parameter *slot indices* come from the order in these tables.
* ``INSTR_DTYPE`` / ``BUFDESC_DTYPE``: numpy structured dtypes of the POD structs the loader packs.
* ``render_header()``: generates ``vm/csrc/amk_abi.h`` (C structs with ``static_assert`` on sizeof/offsetof,
  opcode enum, slot constants). ``python -m vm.abi`` rewrites the file; a test checks the committed header
  matches, and the built extension reports sizeof/offsetof at load so the loader refuses a drifted build.

Semantics of each opcode live in ``vm/reference_vm.py`` (the living spec); CUDA mirrors them in ``vm/csrc/*.cuh``.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

ABI_VERSION = 10

# Caps of the fixed-size instruction POD.
MAX_WAITS = 4
MAX_BUFS = 10
MAX_IPARAMS = 16
MAX_FPARAMS = 4
MAX_PREFETCH = 2

# Buffer dtype codes shared by the IR, the loader and the device code.
DTYPE_CODES = {"f32": 0, "bf16": 1, "f16": 2, "i32": 3, "f32x": 4}
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "f32x": 8}
# "f32x" is a device storage type only: a data-flagged fp32 activation (Buffer.flagged, knob flag_hops), element i
# the 8-byte word bits(value) | tag << 32, the tag saying which launch wrote it (vm/csrc/sync.cuh). Its producers
# store each word relaxed with no fence and its readers poll the words themselves instead of a counter.
# FLAG_SLOTS: the (opcode, slot) pairs whose kernel code reads or writes such a buffer, with the params that must be 0
# for it (GEMV: a merged-partials x, or y accumulated with atomics, cannot be flagged). The validator refuses a flagged
# buffer anywhere else, so a kernel op never reads the words as plain floats.
FLAG_SLOTS = {
    "GEMV": {"x": ("x_splits",), "residual": (), "y": ("accumulate",)},
    "GEMV_SILU_MUL": {"x": (), "h": ()},
    "QKV_ROPE": {"x": ()},
    "ATTN_MERGE": {"out": ()},
}

# AmkBufDesc.kind codes (BufferKind values of schedule/ir.py)
KIND_CODES = {"weight": 0, "activation": 1, "kv_cache": 2, "io_input": 3, "io_output": 4, "const": 5}

# Status words written by the kernel (``status`` array, int32).
STATUS_FIELDS = ("code", "task", "opcode", "detail", "sm")
STATUS_OK, STATUS_BAD_OPCODE, STATUS_TIMEOUT, STATUS_BAD_INPUT = 0, 1, 2, 3
STATUS_NAMES = {STATUS_OK: "ok", STATUS_BAD_OPCODE: "unknown opcode", STATUS_TIMEOUT: "wait timeout",
                STATUS_BAD_INPUT: "bad input"}

# AmkInstr.flags bits
INSTR_FLAG_STREAM = 1   # weights stream through the shared-memory ring (bulk copies); set only for sm_90+ builds
INSTR_FLAG_PRELOAD = 2  # the whole weight tile is bulk-copied into the preload buffer before the task's wait (sm_90+)
INSTR_FLAG_KV_AHEAD = 4  # the NEXT task of this queue is an attention task with early_kv 2: this task's non-waiting
                         # threads issue that task's first KV history tiles before its own wait (amk_kv_ahead,
                         # vm/csrc/ops_attention_mma.cuh)
INSTR_FLAG_WAIT_DATA0 = 16  # (16 << w) for wait w: that wait only orders data-flagged inputs, which the op polls
                            # itself (Wait.data, knob flag_hops): the task loop looks at its counter once, issues the
                            # wait prefetch if it is unmet, and does not spin on it (vm/csrc/sync.cuh)

# QKV_ROPE modes. RAW: the projected rows as they are (no QK-norm, no RoPE) into an fp32 activation laid out like q;
# QK_NORM_ROPE finishes them (models with QK-norm whose QKV tasks are split below whole heads).
QKV_MODE_Q, QKV_MODE_K, QKV_MODE_V, QKV_MODE_RAW = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One opcode: number, buffer slots and parameter names.

    ``inputs``: required input slots, in order. ``optional_inputs``: (slot name, flag iparam) pairs appended after
    the required ones, present iff the flag param is non-zero, in this order. ``outputs``: output slots;
    ``optional_outputs``: (slot name, flag iparam) pairs appended after them, like the optional inputs.
    """
    name: str
    code: int
    family: str  # InstructionKind value
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    iparams: tuple[str, ...]
    fparams: tuple[str, ...] = ()
    optional_inputs: tuple[tuple[str, str], ...] = ()
    optional_outputs: tuple[tuple[str, str], ...] = ()

    def input_slots(self, iparams: dict) -> list[str]:
        """The input slot names a task with these params carries, in order."""
        return list(self.inputs) + [n for n, flag in self.optional_inputs if int(iparams.get(flag, 0))]

    def output_slots(self, iparams: dict) -> list[str]:
        """The output slot names a task with these params carries, in order."""
        return list(self.outputs) + [n for n, flag in self.optional_outputs if int(iparams.get(flag, 0))]

    def slots(self, iparams: dict) -> list[str]:
        """Every slot name of a task with these params: inputs, then outputs (the order of task.inputs + outputs)."""
        return self.input_slots(iparams) + self.output_slots(iparams)

    @property
    def max_inputs(self) -> int:
        return len(self.inputs) + len(self.optional_inputs)

    @property
    def max_outputs(self) -> int:
        return len(self.outputs) + len(self.optional_outputs)


# The attention ops' folded QK-norm (qk_norm / append_k below): optional slots after the required ones
_ATTN_QK_IN = (("q_norm_w", "qk_norm"), ("inv_freq", "qk_norm"), ("k_raw", "append_k"), ("k_norm_w", "append_k"))
_ATTN_QK_OUT = (("k_out", "append_k"),)

_OPS = [
    # x[col_start:col_start+col_count] = table[token[0], same cols]. live_token: token[0] is read after the task's
    # wait (a multi-step launch's step s+1 takes step s's next_token); else the IO_INPUT value read before it
    OpSpec("EMBED", 1, "embed", ("table", "token"), ("x",), ("col_start", "col_count", "vocab", "hidden", "live_token")),
    # y = x * rsqrt(mean(x^2) + eps) * w
    OpSpec("RMSNORM", 2, "norm", ("x", "w"), ("y",), ("n",), ("eps",)),
    # y[r] = residual[r] + bias[r] + W[r,:] . f(x),  f = rmsnorm(.)*norm_w if has_norm else identity.
    # x_splits > 0: x is not a vector but the split-KV attention partials [k / (x_group*x_head_dim), x_splits,
    # x_group, x_head_dim + 2] (rows (m, l, o)), merged by online softmax while staged (ATTN_MERGE's math, fused
    # into o_proj so attention needs no merge task). x_start: x starts at that element of its buffer (with x_splits
    # a whole KV-group block: o_proj split by KV group reads only its group's partials). accumulate: y[r] += the
    # row's value (an atomic fp32 add; tasks accumulating into the same rows need no order among themselves).
    # has_copy: y_copy[r] = y[r] as well (o_proj seeds the next layer's residual stream for fused down tiles).
    # has_argmax: pairs[2*argmax_slot : +2] = (max of the tile's y rows, its row index as a float), the first row on
    # ties, a NaN counting as the maximum (an LM-head tile's share of the next token's argmax; ARGMAX_PAIRS merges)
    OpSpec("GEMV", 3, "gemv", ("x", "w"), ("y",),
           ("row_start", "row_count", "k", "n", "has_norm", "has_bias", "has_residual", "x_splits", "x_group",
            "x_head_dim", "x_start", "accumulate", "has_copy", "has_argmax", "argmax_slot"), ("eps",),
           (("norm_w", "has_norm"), ("bias", "has_bias"), ("residual", "has_residual")),
           (("y_copy", "has_copy"), ("pairs", "has_argmax"))),
    # h[r] = silu(Wg[r,:] . f(x)) * (Wu[r,:] . f(x))
    # dyn_rows > 0: one member (dyn_index j of dyn_tasks N) of a claim group that computes the rows [row_start,
    # row_start+row_count) together (relative rows below): member j first computes its own rows [j*S, (j+1)*S)
    # (S = dyn_static, or dyn_rows where 0), then for each ticket t it draws from the counter dyn_claim (an atomic
    # add; never waited on or signalled by any task) the chunk [N*S + t*dr, +dr) (dr = dyn_rows), until the chunks
    # run out; all ranges clipped to the row count. Every row is computed exactly once, by whichever member drew it,
    # with the arithmetic of a static tile of its size: the result does not depend on the partition. Consumers wait
    # for all members.
    OpSpec("GEMV_SILU_MUL", 4, "gemv", ("x", "w_gate", "w_up"), ("h",),
           ("row_start", "row_count", "k", "n", "has_norm", "dyn_rows", "dyn_index", "dyn_tasks", "dyn_claim",
            "dyn_static"), ("eps",), (("norm_w", "has_norm"),)),
    # per-head projection tile + bias + QK-norm + RoPE; mode Q writes q[head], K/V append to cache[head, pos],
    # RAW writes the projected rows only (fp32, laid out like q) for QK_NORM_ROPE
    OpSpec("QKV_ROPE", 5, "gemv", ("x", "w", "pos", "inv_freq"), ("dst",),
           ("mode", "head_start", "head_count", "head_dim", "k", "n_heads", "max_seq",
            "has_norm", "has_bias", "has_qknorm", "pair_start", "pair_count"), ("eps", "qk_eps"),
           (("norm_w", "has_norm"), ("bias", "has_bias"), ("qk_norm_w", "has_qknorm"))),
    # softmax(q k^T * scale) v for the `group` q heads of one kv head over positions [lo, pos]. early_kv (a hint, no
    # effect on the result): 1 = the kernel issues the cache rows before pos before the task's wait (the lowering sets
    # it where the task's SM is idle before its inputs are ready); 2 = the task BEFORE it in its queue issues them,
    # before that task's own wait (knob early_kv 'ahead'; the attention stages then sit at the top of shared memory)
    # qk_norm (QK-norm models whose QKV tasks write RAW rows; knob fold_qk_norm): `q` holds the group's RAW q rows,
    # and the task itself first applies QK_NORM_ROPE's math to them: q = rope(rmsnorm(q_raw) * q_norm_w) (eps
    # qk_eps). append_k (with qk_norm, on exactly the task whose keys end at pos: ATTN_DECODE, or the last split):
    # the task also finishes the new K row, k_out[kv_head, pos] = rope(rmsnorm(k_raw[kv_head]) * k_norm_w) -- k_out
    # is the k_cache buffer -- before it reads the row at pos. No QK_NORM_ROPE hop remains.
    OpSpec("ATTN_DECODE", 6, "attention", ("q", "k_cache", "v_cache", "pos"), ("out",),
           ("kv_head", "group", "head_dim", "max_seq", "window", "early_kv", "qk_norm", "append_k"),
           ("scale", "qk_eps"), _ATTN_QK_IN, _ATTN_QK_OUT),
    # split-KV partial: unnormalized (m, l, o[hd]) of one split of the positions
    OpSpec("ATTN_PARTIAL", 7, "attention", ("q", "k_cache", "v_cache", "pos"), ("partial",),
           ("kv_head", "group", "head_dim", "max_seq", "window", "split", "n_splits", "early_kv", "qk_norm",
            "append_k"), ("scale", "qk_eps"), _ATTN_QK_IN, _ATTN_QK_OUT),
    # online-softmax merge of the n_splits partials of one kv head
    OpSpec("ATTN_MERGE", 8, "attention", ("partial",), ("out",), ("kv_head", "group", "head_dim", "n_splits")),
    # y[start:start+count] = a + b
    OpSpec("ADD", 9, "elementwise", ("a", "b"), ("y",), ("start", "count")),
    # token[0] = argmax(logits[0:n]) (first index on ties)
    OpSpec("ARGMAX", 10, "reduce", ("logits",), ("token",), ("n",)),
    # no effect on any buffer: asks L2 for w_a[start_a : start_a+count_a] (and the w_b range) so a later task's
    # weights are on chip before it runs; placed where HBM would otherwise idle (lowering knob mlp_prefetch_kb).
    # delay_ns: the requests go out that long after the task starts (knob mlp_prefetch_delay_ns)
    OpSpec("L2_PREFETCH", 11, "prefetch", ("w_a",), (),
           ("start_a", "count_a", "has_b", "start_b", "count_b", "delay_ns"), (), (("w_b", "has_b"),)),
    # QK-norm + RoPE of one KV group from the RAW QKV rows: q[g*G:(g+1)*G] = rope(rmsnorm(q_raw) * q_norm_w) and
    # k_cache[kv_head, pos] = rope(rmsnorm(k_raw[kv_head]) * k_norm_w); per head, over head_dim
    OpSpec("QK_NORM_ROPE", 12, "norm", ("q_raw", "k_raw", "pos", "inv_freq", "q_norm_w", "k_norm_w"),
           ("q", "k_cache"), ("kv_head", "group", "head_dim", "max_seq"), ("eps",)),
    # the split argmax (lowering knob split_argmax): cand[slot] = start + argmax(logits[start:start+count]) (first
    # index on ties, NaN counts as the maximum), one task per LM-head tile, run as soon as that tile is done
    OpSpec("ARGMAX_PARTIAL", 13, "reduce", ("logits",), ("cand",), ("start", "count", "slot")),
    # token[0] = cand[i] for the first i in [0, n_cand) with the largest logits[cand[i]]; with the candidates of
    # ascending disjoint ranges covering [0, n) that is argmax(logits[0:n]) (first index on ties)
    OpSpec("ARGMAX_MERGE", 14, "reduce", ("logits", "cand"), ("token",), ("n", "n_cand")),
    # one MLP tile with its share of down_proj (split-K): h = silu(Wg[r0:r0+rn,:] . f(x)) * (Wu[r0:r0+rn,:] . f(x))
    # stays on chip, then y[0:out_n] += w_down . h (atomic fp32 adds), w_down = down_proj[:, r0:r0+rn] stored as
    # its own contiguous [out_n, rn] block. No down-proj hop: tasks accumulating into y need no order among
    # themselves; y must hold the residual stream first (o_proj's has_copy)
    OpSpec("GEMV_SILU_MUL_DOWN", 15, "gemv", ("x", "w_gate", "w_up", "w_down"), ("y",),
           ("row_start", "row_count", "k", "n", "has_norm", "out_n"), ("eps",), (("norm_w", "has_norm"),)),
    # token[0] = int(pairs[2i+1]) for the first i in [0, n_cand) with the largest pairs[2i] (NaN counts as the
    # maximum): the argmax over the (value, index) pairs of LM-head tiles with has_argmax, one round trip
    OpSpec("ARGMAX_PAIRS", 16, "reduce", ("pairs",), ("token",), ("n_cand",)),
]
OPCODES: dict[str, OpSpec] = {op.name: op for op in _OPS}
OPCODE_BY_CODE: dict[int, OpSpec] = {op.code: op for op in _OPS}
assert len(OPCODE_BY_CODE) == len(_OPS), "duplicate opcode numbers"
for _op in _OPS:
    assert len(_op.iparams) <= MAX_IPARAMS and len(_op.fparams) <= MAX_FPARAMS, _op.name
    assert _op.max_inputs + _op.max_outputs <= MAX_BUFS, _op.name

# ---------------------------------------------------------------------------------------------------------------
# POD structs. Field order and types here ARE the layout; the header is generated from these.
# ---------------------------------------------------------------------------------------------------------------
_INSTR_FIELDS = [
    ("op", "i4", 1), ("out_counter", "i4", 1), ("n_waits", "i4", 1), ("n_bufs", "i4", 1),
    ("wait_counter", "i4", MAX_WAITS), ("wait_threshold", "i4", MAX_WAITS),
    ("buf", "i4", MAX_BUFS), ("ip", "i4", MAX_IPARAMS), ("fp", "f4", MAX_FPARAMS),
    ("task_id", "i4", 1), ("flags", "i4", 1),   # flags: INSTR_FLAG_* bits set by the loader
    # INSTR_FLAG_PRELOAD tasks: instruction index of the next flagged task in the same queue (-1: none, and on every
    # other task). Its tile starts loading into the preload buffer as soon as this task is done with it.
    ("next_preload", "i4", 1),
    # Exact weight byte ranges of the task, in the order the op consumes them (from schedule.ops.weight_ranges; two
    # for GEMV_SILU_MUL: gate rows, up rows). Used for L2 prefetch (capped per launch) and, when INSTR_FLAG_STREAM
    # is set, for streaming the rows through the shared-memory ring with bulk copies (sm_90+).
    ("prefetch_ptr", "u8", MAX_PREFETCH), ("prefetch_bytes", "i8", MAX_PREFETCH),
]
_BUFDESC_FIELDS = [("ptr", "u8", 1), ("numel", "i8", 1), ("dtype", "i4", 1), ("kind", "i4", 1)]
_CTYPES = {"i4": "int32_t", "u4": "uint32_t", "f4": "float", "u8": "uint64_t", "i8": "int64_t"}


def _np_dtype(fields) -> np.dtype:
    return np.dtype([(n, t, (c,)) if c > 1 else (n, t) for n, t, c in fields], align=True)


INSTR_DTYPE = _np_dtype(_INSTR_FIELDS)
BUFDESC_DTYPE = _np_dtype(_BUFDESC_FIELDS)
STRUCTS = {"AmkInstr": (INSTR_DTYPE, _INSTR_FIELDS), "AmkBufDesc": (BUFDESC_DTYPE, _BUFDESC_FIELDS)}


def layout_table() -> dict[str, dict[str, int]]:
    """{struct: {"sizeof": n, field: offset, ...}} -- compared with what the built extension reports."""
    out = {}
    for sname, (dt, fields) in STRUCTS.items():
        d = {"sizeof": dt.itemsize}
        d.update({n: dt.fields[n][1] for n, _, _ in fields})
        out[sname] = d
    return out


def iparam_slot(op: str, name: str) -> int:
    return OPCODES[op].iparams.index(name)


def fparam_slot(op: str, name: str) -> int:
    return OPCODES[op].fparams.index(name)


def render_header() -> str:
    """The C header text: structs + static_asserts + opcode enum + param/buffer slot constants."""
    L = ["// GENERATED by `python -m vm.abi` from vm/abi.py -- do not edit by hand.",
         "#pragma once", "#include <stdint.h>", "#include <stddef.h>", "",
         f"#define AMK_ABI_VERSION {ABI_VERSION}", f"#define AMK_MAX_WAITS {MAX_WAITS}",
         f"#define AMK_MAX_BUFS {MAX_BUFS}", f"#define AMK_MAX_IPARAMS {MAX_IPARAMS}",
         f"#define AMK_MAX_FPARAMS {MAX_FPARAMS}", f"#define AMK_MAX_PREFETCH {MAX_PREFETCH}", ""]
    for k, v in DTYPE_CODES.items():
        L.append(f"#define AMK_DTYPE_{k.upper()} {v}")
    L.append("")
    for k, v in KIND_CODES.items():
        L.append(f"#define AMK_KIND_{k.upper()} {v}")
    L.append("")
    for i, f in enumerate(STATUS_FIELDS):
        L.append(f"#define AMK_STATUS_{f.upper()} {i}")
    L.append(f"#define AMK_STATUS_WORDS {len(STATUS_FIELDS)}")
    for code, nm in ((STATUS_BAD_OPCODE, "BAD_OPCODE"), (STATUS_TIMEOUT, "TIMEOUT"), (STATUS_BAD_INPUT, "BAD_INPUT")):
        L.append(f"#define AMK_ERR_{nm} {code}")
    L += ["", f"#define AMK_INSTR_FLAG_STREAM {INSTR_FLAG_STREAM}",
          f"#define AMK_INSTR_FLAG_PRELOAD {INSTR_FLAG_PRELOAD}", f"#define AMK_INSTR_FLAG_KV_AHEAD {INSTR_FLAG_KV_AHEAD}",
          f"#define AMK_INSTR_FLAG_WAIT_DATA0 {INSTR_FLAG_WAIT_DATA0}",
          f"#define AMK_QKV_MODE_Q {QKV_MODE_Q}", f"#define AMK_QKV_MODE_K {QKV_MODE_K}",
          f"#define AMK_QKV_MODE_V {QKV_MODE_V}", f"#define AMK_QKV_MODE_RAW {QKV_MODE_RAW}", ""]
    for op in _OPS:
        L.append(f"#define AMK_OP_{op.name} {op.code}")
    L.append("")
    for op in _OPS:
        for i, p in enumerate(op.iparams):
            L.append(f"#define AMK_{op.name}_IP_{p.upper()} {i}")
        for i, p in enumerate(op.fparams):
            L.append(f"#define AMK_{op.name}_FP_{p.upper()} {i}")
        for i, b in enumerate(op.inputs):
            L.append(f"#define AMK_{op.name}_IN_{b.upper()} {i}")
        L.append(f"#define AMK_{op.name}_N_REQUIRED_IN {len(op.inputs)}")
        L.append("")
    for sname, (dt, fields) in STRUCTS.items():
        L.append(f"typedef struct {sname} {{")
        for n, t, c in fields:
            L.append(f"  {_CTYPES[t]} {n}{f'[{c}]' if c > 1 else ''};")
        L.append(f"}} {sname};")
        L.append(f"static_assert(sizeof({sname}) == {dt.itemsize}, \"{sname} size drifted from vm/abi.py\");")
        for n, _, _ in fields:
            L.append(f"static_assert(offsetof({sname}, {n}) == {dt.fields[n][1]}, "
                     f"\"{sname}.{n} offset drifted from vm/abi.py\");")
        L.append("")
    # A table the extension exports so the loader can compare layouts at load time.
    L.append("#define AMK_LAYOUT_ENTRIES(X) \\")
    rows = []
    for sname, (dt, fields) in STRUCTS.items():
        rows.append(f"  X({sname}, sizeof, sizeof({sname}))")
        rows += [f"  X({sname}, {n}, offsetof({sname}, {n}))" for n, _, _ in fields]
    L.append(" \\\n".join(rows))
    L.append("")
    return "\n".join(L)


HEADER_PATH = pathlib.Path(__file__).parent / "csrc" / "amk_abi.h"


def write_header(path: pathlib.Path = HEADER_PATH) -> None:
    path.write_text(render_header())


if __name__ == "__main__":
    write_header()
    print(f"wrote {HEADER_PATH}")
