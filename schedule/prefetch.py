"""The gate/up rows a layer asks into L2 while the attention hops leave the HBM mostly idle: its L2_PREFETCH tasks
(knobs mlp_prefetch_kb / _at / _from / _spread), emitted by schedule/lower.py. On an H100 an SM that issues a
prefetch task's requests finds its own next loads queued behind them for ~1-3 us (docs/PERF.md, forty-first
session), so mlp_prefetch_spread gives no SM two of them in a row."""
from __future__ import annotations


def prefetch_owners(sms: int, n_qkv: int, n_attn: int, n_merge: int, n_tiles: int) -> int:
    """L2_PREFETCH tasks per layer under mlp_prefetch_spread: the SMs free when a layer's last QKV group is done --
    its QKV SMs, less those the list placement gives a merge (the merges take the SMs neither QKV nor attention
    uses first) -- where they number at least half the gate/up tiles; else one task per tile."""
    free = n_qkv - max(0, n_merge - max(0, sms - n_qkv - n_attn))
    return free if 0 < free < n_tiles <= 2 * free else n_tiles


def spread_prefetch(tiles: list[tuple[int, int]], head_rows: list[int], owners: int) -> list[tuple[int, int, int, int]]:
    """Per L2_PREFETCH task (r0, rn, e0, en): the first ``owners`` tiles (r0, rn) keep one task each (their head:
    head_rows[i] rows from r0); the head of every later tile is cut into whole-row ranges [e0, e0 + en), one per
    task, over as many tasks as evenly as they go (en = 0: the task has none)."""
    extra = [(0, 0)] * owners
    rest = len(tiles) - owners
    for i, (r0, _) in enumerate(tiles[owners:]):
        lo, hi = i * owners // rest, (i + 1) * owners // rest
        rows = head_rows[owners + i]
        for j in range(lo, hi):
            a, z = rows * (j - lo) // (hi - lo), rows * (j - lo + 1) // (hi - lo)
            extra[j] = (r0 + a, z - a)
    return [(r0, rn, e0, en) for (r0, rn), (e0, en) in zip(tiles[:owners], extra)]


def mlp_prefetch(b, cfg, l: int, wg: int, wu: int, H: int, tiles: list[tuple[int, int]], trigger: int,
                 owners: int) -> None:
    """The L2_PREFETCH tasks of layer l's gate/up tiles: mlp_prefetch_kb KB of each tile's rows (mlp_prefetch_from).
    With fewer owners than tiles (mlp_prefetch_spread) a task also asks for a row range of a later tile's gate
    head (its second range, on the gate matrix again), so no SM runs two of them in front of its o_proj tile."""
    total = cfg.mlp_prefetch_kb * 1024 // b.dtype.nbytes   # elements asked for per tile
    head_rows = [min(rn * H, total) // H for _, rn in tiles]
    for r0, rn, e0, en in spread_prefetch(tiles, head_rows, owners):
        if cfg.mlp_prefetch_from == "both":   # the head of the gate rows and of the up rows
            na = nb = min(rn * H, total // 2)
            sb, ins = r0 * H, [wg, wu]
        else:   # the gate rows first (every warp load pairs an L2 hit with a miss), then a share of another tile's
            na = min(rn * H, total)   # gate head (spread) or the head of its own up rows
            sb, nb, ins = (e0 * H, en * H, [wg, wg]) if en else (r0 * H, min(rn * H, total - na), [wg, wu])
        b.task("L2_PREFETCH", ins if nb else [wg], [],
               {"start_a": r0 * H, "count_a": na, "has_b": int(nb > 0), "start_b": sb if nb else 0, "count_b": nb,
                "delay_ns": cfg.mlp_prefetch_delay_ns},
               [trigger], -1, f"L{l}.prefetch[{r0}:{r0 + rn}]" + (f"+[{e0}:{e0 + en}]" if en else ""))
