"""The lowering's auto rules: what a knob left at 0 / 'auto' resolves to for a model's shapes, the target's SM
count and the KV-cache length -- row tiles (GEMV, MLP, LM head), QKV tasks per head, attention splits, the SM
assignment. Each rule's docstring names the H100 / H200 measurements that chose it (docs/PERF.md); the lowering
(schedule/lower.py) calls them, tests/schedule/test_auto_rules.py checks them on hand-computed cases."""
from __future__ import annotations


def tiles(n: int, size: int):
    """(start, count) tiles of ``size`` covering [0, n), the last one shorter."""
    for s in range(0, n, size):
        yield s, min(size, n - s)


LM_HEAD_AUTO_ROWS = 512   # lm_head_rows 0 (auto): tiles of at most this many rows, in whole waves of SMs
LM_HEAD_ONE_WAVE_ROWS = 2048   # ... or one wave of one tile per SM where that needs at most this many rows a tile


def lm_head_tiles(vocab: int, rows: int, n_sms: int) -> list[tuple[int, int]]:
    """(start, count) tiles of the LM head. rows > 0: that many rows each (the last one shorter). 0 (auto): a head
    that needs more than one wave of LM_HEAD_AUTO_ROWS-row tiles becomes ONE wave of n_sms tiles where those are at
    most LM_HEAD_ONE_WAVE_ROWS rows (132 SMs: the llama presets' 132 tiles of 971-972 rows instead of two waves of
    486, qwen3's 1151-1152 rows instead of three waves of 384; H100 -0.2..-0.4% on llama-3.2-1b, -0.3% on
    llama-3.2-3b, -1.0% on qwen3-0.6b: one tile's fixed costs per SM instead of two or three, docs/PERF.md
    forty-sixth session), else its tile count rounded up to whole waves (sizes then differ by <= 1 row), so the last
    wave does not run on a few SMs (the eleventh session's qwen3-0.6b: 297 tiles of 512 rows left 33 SMs streaming a
    third wave alone). A head of one wave or less keeps its tiles of at most 512 rows."""
    if rows > 0:
        return list(tiles(vocab, rows))
    k = -(-vocab // LM_HEAD_AUTO_ROWS)
    if k > n_sms > 0:
        k = n_sms if -(-vocab // n_sms) <= LM_HEAD_ONE_WAVE_ROWS else min(vocab, -(-k // n_sms) * n_sms)
    return [(vocab * i // k, vocab * (i + 1) // k - vocab * i // k) for i in range(k)]


AUTO_MIN_ROWS = 4   # auto row tiles never go below this: smaller tiles are all fixed per-task cost


def auto_rows(n: int, n_sms: int, warps: int) -> int:
    """Rows per tile for row-tile knob 0 (auto): the smallest warp-friendly count whose tiles fit one wave of
    ``n_sms`` SMs. Below ``warps`` rows a power of two of at least AUTO_MIN_ROWS (warps split each row's K range
    evenly), from there a multiple of ``warps`` (every warp owns the same number of rows). Measured on an H100
    (docs/PERF.md, sixth and seventh sessions): each model's best fixed size puts ~one tile per SM, and the old fixed
    16 / 64 rows were 3-9% slower than auto on qwen3-0.6b, llama-3.2-3b and llama-3.1-8b."""
    need = max(1, -(-n // max(1, n_sms)))
    if need <= warps:
        r = AUTO_MIN_ROWS
        while r < need:
            r *= 2
        return r
    return -(-need // warps) * warps


def qkv_split_for(knob: int, qkv_heads: int, n_heads: int, n_kv: int, head_dim: int, n_sms: int,
                  reserve: int = 0) -> int:
    """QKV tasks per head. knob > 0: that many where it divides head_dim/2 (else 1). 0 (auto): the largest of
    1, 2, 4, 8 that divides head_dim/2 and keeps the QKV tasks ((n_heads + 2*n_kv) x split) plus ``reserve`` SMs
    within one wave of SMs, else (no split of 2 or more leaves that room: whole heads measured slower, +0.7% on
    Qwen3-0.6B against 4 per head) the largest that fits the wave alone. ``reserve``
    (qkv_reserve): the attention tasks the idle placement puts on the SMs the QKV phase leaves free, so they load
    their KV history before their wait. 2 on the Llama presets (with or without the reserve) and on Qwen3-0.6B
    (64 QKV tasks + 8 x 4 attention tasks; 4 without the reserve, 128 QKV tasks: 1.7-3.4% slower, H100 and H200,
    docs/PERF.md, twenty-fourth session). Only with qkv_heads=1."""
    if qkv_heads != 1:
        return 1
    ok = [s for s in (1, 2, 4, 8) if (head_dim // 2) % s == 0]
    if knob > 0:
        return knob if knob in ok else 1
    fits = lambda s, r: (n_heads + 2 * n_kv) * s + r <= n_sms  # noqa: E731
    return max([s for s in ok if s > 1 and fits(s, reserve)] or [s for s in ok if fits(s, 0)] or [1])


def qkv_reserve(cfg, n_kv: int, max_seq: int) -> int:
    """SMs the auto QKV split leaves for attention: n_kv x splits where the SM assignment may put attention on the
    SMs the QKV phase leaves idle ('auto' / 'list_idle') and the splits are known to be few (the attn_splits knob,
    or the fewest of auto's IDLE_SPLITS up to AUTO_SPLITS_MAX_SEQ positions); 0 otherwise (long context: one wave
    of splits)."""
    if cfg.sm_assignment not in IDLE_POLICIES:
        return 0
    splits = cfg.attn_splits or (IDLE_SPLITS[-1] if max_seq <= AUTO_SPLITS_MAX_SEQ else 0)
    return n_kv * min(splits, max_seq)


def rows_for(knob: int, n: int, n_sms: int, warps: int) -> int:
    """Rows per tile of an n-row GEMV-family matrix: the knob's value, or auto_rows for 0."""
    return knob if knob > 0 else auto_rows(n, n_sms, warps)


AUTO_SPLITS, AUTO_SPLITS_MAX_SEQ = 8, 2048   # attn_splits 0 (auto): this many up to this KV-cache length
IDLE_SPLITS = (8, 4)   # ... or the most of these whose tasks fit the SMs the QKV phase leaves idle
IDLE8_MAX_QKV_BYTES = 128 * 1024   # ... 8 of them only where no QKV task streams more weight bytes than this
IDLE_POLICIES = ("auto", "list_idle")   # sm_assignment values that may put attention on the SMs QKV leaves idle


def attn_splits_for(knob: int, n_kv: int, max_seq: int, n_sms: int, idle_sms: int = 0,
                    qkv_tile_bytes: int = 0) -> int:
    """Split-KV tasks per KV head. knob > 0: that many (at most one per position). 0 (auto): up to 2048 positions
    of KV cache, the most of IDLE_SPLITS (8, 4) whose n_kv x splits attention tasks fit on the ``idle_sms`` SMs the
    QKV phase leaves idle (the SM assignment puts them there and they load their KV before their wait) -- 8 only
    where no QKV task streams more than IDLE8_MAX_QKV_BYTES (``qkv_tile_bytes``: the largest QKV task's weight
    bytes) -- else 8; beyond 2048 positions, one wave of attention tasks (n_kv * splits <= n_sms, at least 8, at
    most 64). Measured on an H100: 4 on the idle SMs beats 8 that do not fit there (llama-3.2-1b / -3b / 3.1-8b
    3.4% / 0.7% / 1.6%, docs/PERF.md, thirteenth session; llama-3.2-1b ctx 512 +7.1% with 8, thirty-ninth); where
    8 fit too, 8 beat 4 on qwen3-0.6b (128 KiB QKV tasks: ctx 512 -1.7%, ctx 2048 -2.7%, thirty-ninth session) and
    lost on qwen3-1.7b (the same attention shape, 256 KiB QKV tasks: +1.0%, fortieth) -- the byte bound sits
    between those two measured points. On llama-3.2-1b without the idle placement (fifth session) 8 is best at
    ctx 512 (16: +2%; 4: +0.6%); 16 is best at 8192 and 32768 (8: +13% / +38%; 24, 32, 64 tasks per head spill
    into a second wave: +10% to +33%)."""
    if knob > 0:
        return min(knob, max_seq)
    if max_seq <= AUTO_SPLITS_MAX_SEQ:
        fit = [s for s in IDLE_SPLITS if n_kv * s <= idle_sms and (s <= 4 or qkv_tile_bytes <= IDLE8_MAX_QKV_BYTES)]
        return min(fit[0] if fit else AUTO_SPLITS, max_seq)
    return min(64, max_seq, max(AUTO_SPLITS, n_sms // max(1, n_kv)))


def assignment_for(policy: str, n_kv: int, splits: int, idle_sms: int) -> str:
    """The SM assignment policy: the knob's value, or for 'auto' 'list_idle' where a layer's n_kv x splits attention
    tasks fit on the SMs its QKV tasks leave idle (else 'list')."""
    if policy != "auto":
        return policy
    return "list_idle" if n_kv * splits <= idle_sms else "list"
