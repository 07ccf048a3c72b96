"""Shared-memory layout of each task on the GPU VM: the mirror of ``amk_smem_floats`` (vm/csrc/megakernel.cu),
``amk_attn_smem`` (vm/csrc/attn_common.cuh), ``amk_norm_floats`` (ops_embed_norm.cuh) and ``amk_stash_floats``
(stream.cuh). The loader sizes the launch's dynamic shared memory from these; the kernel checks each task's need
against the launch and reports BAD_INPUT naming the task if they ever disagree.

Pure functions of a task's params and the build knobs (threads, ring stage, attention stages): no GPU needed.
"""
from __future__ import annotations

from schedule.ops import gemv_x_elems

ATTN_TILE, ATTN_RGMAX = 256, 32   # must match vm/csrc/common.cuh (and AMK_ATTN_GB below)
ATTN_STAGES, ATTN_STAGE_BYTES = 2, 32768   # default attention KV stages (jit.BuildSpec.attn_stages / _bytes)
RING_SLICE_BYTES = 4096   # AMK_RING_SLICE_BYTES: a streamed row is cut into K-slices of at most this many bytes
STREAM_OPS = {"GEMV": 1, "GEMV_SILU_MUL": 2, "QKV_ROPE": 1}   # op -> weight matrices streamed through the ring


def _attn_rg(hd: int, threads: int) -> int:
    r = threads // max(1, hd // 2)
    return max(1, min(ATTN_RGMAX, r))


def _attn_gb(threads: int) -> int:
    """AMK_ATTN_GB: q heads per register block of the attention op (vm/csrc/common.cuh)."""
    return 4


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _stream_rows(task) -> int:
    p = task.params
    return int(p["head_count"]) * int(p["head_dim"]) if task.op == "QKV_ROPE" else int(p["row_count"])


def stash_floats(task, threads: int, weight_bytes: int, stage_bytes: int) -> int:
    """Per-warp partials of a task streamed through the weight ring (mirror of amk_stash_floats); 0 if it is not."""
    nmat = STREAM_OPS.get(task.op, 0)
    row_bytes = int(task.params.get("k", 0)) * weight_bytes
    if not (stage_bytes and nmat and row_bytes and row_bytes % 16 == 0 and nmat * row_bytes <= stage_bytes):
        return 0
    nw = threads // 32
    wpr = min(max(-(-row_bytes // RING_SLICE_BYTES), 1), nw)   # K-slices per row (amk_stream_wpr)
    return _pad4(_stream_rows(task) * nmat * wpr)


def merged_x_floats(p: dict) -> int:
    """Elements of the attention-partials buffer a GEMV with x_splits > 0 merges into its x (0 otherwise): mirror
    of amk_merged_x_floats in vm/csrc/ops_gemv.cuh."""
    ns, G, hd = (int(p.get(k, 0)) for k in ("x_splits", "x_group", "x_head_dim"))
    return gemv_x_elems(p) if ns > 0 and G > 0 and hd > 0 else 0


def norm_floats(task) -> int:
    """Floats after a task's op area holding its fused RMSNorm weight, staged before its wait -- mirror of
    amk_norm_floats in vm/csrc/ops_embed_norm.cuh."""
    p = task.params
    if task.op == "RMSNORM":
        return _pad4(int(p["n"]))
    if task.op in ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN", "QKV_ROPE") and int(p.get("has_norm", 0)):
        return _pad4(int(p["k"]))
    return 0


def attn_keys(head_dim: int, elem_bytes: int, stage_bytes: int = ATTN_STAGE_BYTES) -> int:
    """Keys per attention tile: K and V rows of the tile fill one stage, rounded down to a multiple of 4 when at
    least 4 fit (mirror of amk_attn_keys; 0 = one key's rows do not fit a stage)."""
    k = stage_bytes // (2 * max(1, head_dim) * elem_bytes)
    return min(ATTN_TILE, k & ~3 if k >= 4 else k)


def attn_areas(G: int, D: int, threads: int, stage_bytes: int = ATTN_STAGE_BYTES) -> dict[str, int]:
    """Offsets (floats) of an attention task's areas: q at 0 | o | sc (scores) | red (P.V partials) | st (m, l,
    alpha) | kv (the KV stages, from a 128-byte boundary) -- mirror of amk_attn_smem in vm/csrc/attn_common.cuh."""
    rg, gb = _attn_rg(D, threads), min(G, _attn_gb(threads))
    o = _pad4(G * D)
    sc = o + _pad4(G * D)
    red = sc + _pad4(G * attn_keys(D, 2, stage_bytes))
    st = red + _pad4(rg * gb * D)
    return {"o": o, "sc": sc, "red": red, "st": st, "kv": (st + _pad4(3 * G) + 31) // 32 * 32}


def attn_floats(G: int, D: int, threads: int, stages: int = ATTN_STAGES, stage_bytes: int = ATTN_STAGE_BYTES) -> int:
    """Shared memory (floats) of an attention task: q | o | scores | P.V partials | (m, l, alpha) | KV stages, the
    stages from a 128-byte boundary (mirror of amk_attn_smem in vm/csrc/attn_common.cuh)."""
    return attn_areas(G, D, threads, stage_bytes)["kv"] + stages * stage_bytes // 4


def attn_fold_fits(G: int, D: int, threads: int, stage_bytes: int = ATTN_STAGE_BYTES) -> bool:
    """Whether an attention task's folded QK-norm (qk_norm) has its scratch -- the RAW K row, both norm weights and
    inv_freq, 3.5 * D floats -- between the score area and the KV stages (mirror of amk_attn_fold_fits)."""
    a = attn_areas(G, D, threads, stage_bytes)
    return D >= 2 and D % 2 == 0 and a["kv"] - a["sc"] >= 3 * D + D // 2


def smem_floats(task, threads: int, weight_bytes: int = 4, stage_bytes: int = 0,
                attn: tuple[int, int] = (ATTN_STAGES, ATTN_STAGE_BYTES), kv_top: bool = False) -> int:
    """Dynamic shared memory (floats) of a task: its op area (mirror of amk_smem_floats in
    vm/csrc/megakernel.cu) plus its staged norm weight (norm_floats). weight_bytes / stage_bytes: the weight dtype
    size and ring stage size (0 = no ring) for the stash term; attn: the build's attention (stages, stage bytes);
    kv_top: a kv_ahead build, whose attention stages are one region at the top of shared memory (kv_region_bytes),
    not part of any op area."""
    return _op_floats(task, threads, weight_bytes, stage_bytes, attn, kv_top) + norm_floats(task)


def kv_region_bytes(attn: tuple[int, int] = (ATTN_STAGES, ATTN_STAGE_BYTES)) -> int:
    """Bytes of the attention stage region at the top of shared memory in kv_ahead builds (AMK_KV_REGION)."""
    return attn[0] * attn[1]


def _op_floats(task, threads: int, weight_bytes: int, stage_bytes: int, attn: tuple[int, int],
               kv_top: bool = False) -> int:
    p = task.params
    stash = stash_floats(task, threads, weight_bytes, stage_bytes)
    if task.op == "RMSNORM":
        return _pad4(int(p["n"]))
    if task.op == "GEMV":  # x | stash | staged residual rows | the attention partials of a merged x
        return (_pad4(int(p["k"])) + stash + (_pad4(int(p["row_count"])) if int(p.get("has_residual", 0)) else 0)
                + _pad4(merged_x_floats(p)))
    if task.op == "GEMV_SILU_MUL":
        return _pad4(int(p["k"])) + stash
    if task.op == "GEMV_SILU_MUL_DOWN":   # x | the tile's SiLU*up rows (never streamed through the ring)
        return _pad4(int(p["k"])) + _pad4(int(p["row_count"]))
    if task.op == "QKV_ROPE":
        return _pad4(int(p["k"])) + _pad4(int(p["head_count"]) * int(p["head_dim"])) + stash
    if task.op == "QK_NORM_ROPE":   # raw rows | q and k norm weights | inv_freq, all fp32
        hd = int(p["head_dim"])
        return _pad4((int(p["group"]) + 1) * hd) + 2 * hd + _pad4(hd // 2)
    if task.op in ("ATTN_DECODE", "ATTN_PARTIAL"):
        return attn_floats(int(p["group"]), int(p["head_dim"]), threads, *attn) - (kv_region_bytes(attn) // 4
                                                                                    if kv_top else 0)
    return 0
