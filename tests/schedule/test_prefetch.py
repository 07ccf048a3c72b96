"""schedule/prefetch.py: how mlp_prefetch_spread deals the gate/up tiles' heads out to fewer L2_PREFETCH tasks
(hand-checked small cases) and how many tasks the list placement leaves room for."""
import pytest

from schedule.prefetch import prefetch_owners, spread_prefetch


def test_spread_deals_the_later_tiles_heads_out_in_whole_rows():
    tiles = [(0, 64), (64, 64), (128, 64), (192, 64)]   # 4 tiles of 64 rows, heads of 48 rows
    # 3 owners: the 4th tile's head (rows 192..240) in three 16-row ranges
    assert spread_prefetch(tiles, [48] * 4, 3) == [(0, 64, 192, 16), (64, 64, 208, 16), (128, 64, 224, 16)]
    # 2 owners, 2 later tiles: one whole later head each
    assert spread_prefetch(tiles, [48] * 4, 2) == [(0, 64, 128, 48), (64, 64, 192, 48)]
    # 3 owners, uneven: 10 rows in 4 + 3 + 3... as whole rows (3 + 3 + 4)
    assert spread_prefetch(tiles, [48, 48, 48, 10], 3) == [(0, 64, 192, 3), (64, 64, 195, 3), (128, 64, 198, 4)]
    # as many owners as tiles: nothing to deal out
    assert spread_prefetch(tiles, [48] * 4, 4) == [(r0, rn, 0, 0) for r0, rn in tiles]


def test_spread_with_more_owners_than_two_per_later_tile():
    tiles = [(i * 8, 8) for i in range(5)]
    out = spread_prefetch(tiles, [8] * 5, 4)   # one later tile (rows 32..40) over 4 tasks: 2 rows each
    assert [(e0, en) for _, _, e0, en in out] == [(32, 2), (34, 2), (36, 2), (38, 2)]
    # every row of every head asked for exactly once
    rows = [r for r0, rn, e0, en in out for r in list(range(r0, r0 + 8)) + list(range(e0, e0 + en))]
    assert sorted(rows) == list(range(40))


@pytest.mark.parametrize("sms,n_qkv,n_attn,n_merge,n_tiles,want", [
    (132, 96, 32, 8, 128, 92),    # llama-3.2-1b: 4 spare SMs take 4 merges, 4 go to QKV SMs
    (132, 96, 32, 0, 128, 96),    # no merge tasks
    (132, 96, 32, 8, 92, 92),     # no more tiles than free SMs: one task per tile
    (132, 40, 32, 8, 128, 128),   # fewer free SMs than half the tiles: one task per tile
    (132, 100, 40, 8, 130, 92),   # no spare SM: every merge on a QKV SM
])
def test_prefetch_owners(sms, n_qkv, n_attn, n_merge, n_tiles, want):
    assert prefetch_owners(sms, n_qkv, n_attn, n_merge, n_tiles) == want
