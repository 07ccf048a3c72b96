"""The auto rules of the lowering (knob value 0 / 'auto'): what each resolves to per model shape, SM count, context
and target, hand-computed, and that the auto program equals the one with the resolved value given explicitly. The
values these rules pick were measured on an H100 (docs/PERF.md; the rules' docstrings in schedule/lower.py say
which session); tests/schedule/test_knobs.py checks that every knob's explicit values change the program."""
from __future__ import annotations

import dataclasses

import pytest

from flywheel.prior import defaults
from schedule.ir import ScheduleConfig
from schedule.auto_rules import qkv_reserve, qkv_split_for
from schedule.lower import lower
from tests.schedule.lower_helpers import H100, LLAMA1B, count, model, structure


@pytest.mark.parametrize("name,sms,tiles,cap", [("toy", 132, 1, 313), ("llama-3.2-1b", 132, 132, 972),
                                                  ("qwen3-0.6b", 132, 132, 1152), ("llama-3.2-1b", 64, 64, 2004),
                                                  ("qwen3-0.6b", 100, 100, 1520), ("qwen3-0.6b", 74, 370, 411),
                                                  ("llama-3.2-1b", 62, 310, 414)])
def test_lm_head_rows_auto_fills_whole_waves(name, sms, tiles, cap):
    """lm_head_rows 0: tiles of at most 512 rows; more tiles than SMs -> one wave of one tile per SM where those are
    at most 2048 rows (llama's 128256 rows: 972 on 132 SMs, 2004 on 64; qwen3's 151936: 1152 on 132), else the
    512-row tile count rounded up to whole waves (qwen3 on 74 SMs would need 2054 rows: 297 tiles -> 5 waves of 74;
    llama on 62 SMs 2069: 251 -> 5 waves of 62); sizes within one row of each other (cap: the largest, hand-computed),
    covering the vocabulary once in order."""
    g = model(name)
    p = lower(g, H100, {**defaults(), "num_sms": sms}, max_seq=64)
    lm = [t for t in p.tasks if t.label.startswith("lm_head")]
    assert len(lm) == tiles and (tiles <= sms or tiles % sms == 0)
    rows = [t.params["row_count"] for t in lm]
    assert max(rows) == cap and max(rows) - min(rows) <= (1 if tiles > 1 else 0)
    assert [t.params["row_start"] for t in lm] == [sum(rows[:i]) for i in range(tiles)]
    assert sum(rows) == g.config.vocab


@pytest.mark.parametrize("name,sms,cfg,max_seq,want", [
    ("toy", 132, {}, 64, 8), ("llama-3.2-1b", 132, {}, 64, 2), ("llama-3.1-8b", 132, {}, 64, 2),
    ("llama-3.2-3b", 132, {}, 64, 2),
    # 4 x 32 = 128 QKV tasks leave 4 SMs: 2 per head leaves 68 for the 8 x 4 attention tasks
    ("qwen3-0.6b", 132, {}, 64, 2), ("qwen3-0.6b", 132, {"attn_splits": 8}, 64, 2),   # 64 + 64 <= 132
    ("qwen3-0.6b", 132, {"sm_assignment": "list"}, 64, 4),    # no idle placement: one wave of QKV tasks
    ("qwen3-0.6b", 132, {}, 8192, 4),                         # long context: one wave of splits, no reserve
    ("qwen3-0.6b", 132, {"attn_splits": 16}, 64, 4),          # 64 + 128 > 132: the wave alone
    ("qwen3-0.6b", 100, {}, 64, 2), ("llama-3.2-1b", 40, {}, 64, 1)])
def test_qkv_head_split_auto(name, sms, cfg, max_seq, want):
    """qkv_head_split 0: the largest split whose (n_heads + 2 n_kv) x split QKV tasks fit one wave of SMs next to
    the reserve the idle placement needs for attention (n_kv x splits: sm_assignment auto / list_idle and few
    splits), else in one wave alone; and the same program as that split given explicitly."""
    g = model(name)
    c = g.config
    conf = ScheduleConfig(**{**cfg, "num_sms": sms})
    reserve = qkv_reserve(conf, c.n_kv_heads, max_seq)
    assert qkv_split_for(0, 1, c.n_heads, c.n_kv_heads, c.head_dim, sms, reserve) == want
    assert want == 1 or (c.n_heads + 2 * c.n_kv_heads) * want <= sms   # 1 when even whole heads do not fit
    auto = lower(g, H100, {**defaults(), **cfg, "num_sms": sms}, max_seq=max_seq)
    explicit = lower(g, H100, {**defaults(), **cfg, "num_sms": sms, "qkv_head_split": want}, max_seq=max_seq)
    assert structure(auto) == structure(explicit)
    assert qkv_split_for(0, 2, c.n_heads, c.n_kv_heads, c.head_dim, sms) == 1   # several q heads per task: no split


def test_qkv_reserve():
    """The reserve follows the placement and the split count: n_kv x 4 (auto splits) up to 2048 positions, n_kv x
    the knob's splits, none under the 'list' / 'lpt' / 'round_robin' placements or auto splits at long context."""
    assert qkv_reserve(ScheduleConfig(), 8, 512) == 32
    assert qkv_reserve(ScheduleConfig(sm_assignment="list_idle"), 8, 2048) == 32
    assert qkv_reserve(ScheduleConfig(), 8, 2049) == 0
    assert qkv_reserve(ScheduleConfig(attn_splits=8), 8, 8192) == 64
    assert qkv_reserve(ScheduleConfig(attn_splits=8), 8, 5) == 40   # at most one split per position
    for pol in ("list", "lpt", "round_robin"):
        assert qkv_reserve(ScheduleConfig(sm_assignment=pol), 8, 512) == 0


@pytest.mark.parametrize("max_seq,n_sms,splits,prefetch", [
    (64, 132, 4, True),        # short cache: 4 splits, the 32 attention tasks fit the 36 SMs QKV leaves idle
    (2048, 132, 4, True),
    (2048, 100, 8, False),     # 100 SMs: QKV (96 tasks) leaves 4 idle: 8 splits; 64 tasks > 100 / 2: no prefetch
    (4096, 132, 16, False),    # long cache: one wave (8 kv heads x 16 = 128 <= 132 SMs), no SM idle for prefetch
    (4096, 64, 8, False),      # at least 8 splits; 64 tasks on 64 SMs
    (4096, 40, 8, False),
])
def test_auto_attn_splits_and_prefetch_gating(max_seq, n_sms, splits, prefetch):
    """attn_splits 0 (auto) picks the split per KV-cache length and SM count (and the SMs the QKV phase leaves idle);
    L2_PREFETCH tasks only where the attention tasks leave at least half of the SMs idle (llama-3.2-1b shapes: 8 kv
    heads, 16 layers)."""
    g = LLAMA1B
    cfg = {**defaults(), "attn_splits": 0, "mlp_prefetch_kb": 64, "num_sms": n_sms}
    p = lower(g, H100, cfg, max_seq=max_seq)
    nkv, nl = g.config.n_kv_heads, g.config.n_layers
    assert p.meta["attn_splits"] == splits
    assert count(p, "ATTN_PARTIAL") == splits * nkv * nl and count(p, "ATTN_MERGE") == nkv * nl
    assert (count(p, "L2_PREFETCH") == count(p, "GEMV_SILU_MUL")) if prefetch else count(p, "L2_PREFETCH") == 0
    # an explicit split count is taken as given, capped at one task per position
    assert lower(g, H100, {**cfg, "attn_splits": 3}, max_seq=max_seq).meta["attn_splits"] == 3
    assert lower(g, H100, {**cfg, "attn_splits": 64}, max_seq=32).meta["attn_splits"] == 32


@pytest.mark.parametrize("name,n_sms,threads,o_rows,mlp_rows", [
    ("qwen3-0.6b", 132, 512, 8, 32),       # 1024 / 132 -> 8 (128 tiles); 3072 / 132 = 23.3 -> 32 (16 warps, 96 tiles)
    ("llama-3.2-1b", 132, 512, 16, 64),    # 128 tiles each: the measured best fixed sizes
    ("llama-3.2-3b", 132, 512, 32, 64),    # 3072 / 132 = 23.3 -> 32: 96 tiles, not 192 (1.45 waves) of 16
    ("llama-3.1-8b", 132, 512, 32, 112),   # 14336 / 132 = 108.6 -> 112: 128 tiles
    ("llama-3.2-1b", 64, 512, 32, 128),    # fewer SMs: bigger tiles
    ("llama-3.2-1b", 132, 256, 16, 64),    # 8 warps: 62.1 rows -> 64 (a multiple of 8)
    ("llama-3.2-1b", 100, 256, 24, 88),    # 2048 / 100 = 20.5 -> 24; 8192 / 100 = 81.9 -> 88
])
def test_auto_row_tiles_fit_one_wave(name, n_sms, threads, o_rows, mlp_rows):
    """gemv_rows / mlp_rows 0 (auto): the smallest warp-friendly tile whose count fits one wave of the SMs."""
    g = model(name)
    c = g.config
    p = lower(g, H100, {**defaults(), "num_sms": n_sms, "threads_per_block": threads}, max_seq=64)
    for op, lab, n, rows in (("GEMV", "L0.o_proj[", c.hidden, o_rows), ("GEMV", "L0.down[", c.hidden, o_rows),
                             ("GEMV_SILU_MUL", "L0.gate_up[", c.intermediate, mlp_rows)):
        tiles = [t for t in p.tasks if t.op == op and t.label.startswith(lab)]
        assert tiles[0].params["row_count"] == rows, lab
        assert len(tiles) == -(-n // rows) <= n_sms
        assert sum(t.params["row_count"] for t in tiles) == n
    # an explicit size is taken as given
    q = lower(g, H100, {**defaults(), "num_sms": n_sms, "gemv_rows": 4, "mlp_rows": 128}, max_seq=64)
    assert {t.params["row_count"] for t in q.tasks if t.label.startswith("L0.o_proj[")} == {4}
    assert {t.params["row_count"] for t in q.tasks if t.label.startswith("L0.gate_up[")} == {128}


@pytest.mark.parametrize("name,splits,smem,fused", [
    ("llama-3.2-1b", 8, 232448, True),      # 8 x 8 x 4 x 66 floats = 67.6 KB of partials + x + rows: fits
    ("llama-3.2-1b", 16, 232448, True),     # 135 KB
    ("llama-3.1-8b", 16, 232448, False),    # 8 x 16 x 4 x 130 floats = 266 KB: ATTN_MERGE tasks stay
    ("llama-3.2-1b", 8, 65536, False),      # a 64 KB target: ATTN_MERGE tasks stay
])
def test_attn_merge_is_fused_only_where_the_partials_fit(name, splits, smem, fused):
    g = model(name)
    target = dataclasses.replace(H100, smem_per_block=smem)
    p = lower(g, target, {**defaults(), "attn_splits": splits, "fuse_attn_merge": True}, max_seq=4096)
    nkv, nl = g.config.n_kv_heads, g.config.n_layers
    o = [t for t in p.tasks if ".o_proj[" in t.label]
    if fused:
        assert count(p, "ATTN_MERGE") == 0 and all(t.params["x_splits"] == splits for t in o)
        floats = o[0].params["k"] + o[0].params["row_count"] + nkv * splits * g.config.group * (g.config.head_dim + 2)
        assert 4 * floats <= smem
    else:
        assert count(p, "ATTN_MERGE") == nkv * nl and all(t.params.get("x_splits", 0) == 0 for t in o)
