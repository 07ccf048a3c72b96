"""scripts/ring_projection.py: the pipe_micro table parsed (runs averaged) and its deltas applied to a layer,
checked against the fiftieth session's two runs computed by hand."""
from __future__ import annotations

import pytest

from scripts.ring_projection import main, parse_layer, parse_micro, project

BASE = "reg pf64 gate192 (the megakernel's prefetches)"
RUN = """pipe_micro: 132 SMs, 16 layers x 6 phases, 2007.0 MB of weights (928 KB per SM per layer)

| variant | step us (median of 5) | TB/s | SMs used | y vs reg | qkv | attn | merge | o_proj | gate/up | down |
|---|---|---|---|---|---|---|---|---|---|---|
| reg | 929.4 | 2.16 | 132 | 0 differ | 6.59 | 4.99 | 2.56 | 5.27 | 24.94 | 13.64 |
| {base} | {b_step} | 2.16 | 132 | 0 differ | {b} |
| tma 24x8K win6 | {r_step} | 2.50 | 132 | 0 differ | {r} |
| tma 24x8K win6 split | 1386.0 | 1.45 | 132 | 410802 differ | 9.39 | 5.30 | 2.58 | 6.74 | 41.05 | 21.35 |

family columns: mean window per layer (us), layers 1-15
"""
TEXT = (RUN.format(base=BASE, b_step=927.3, b="6.74 | 7.01 | 2.52 | 6.58 | 22.68 | 12.48", r_step=802.6,
                   r="4.98 | 6.28 | 3.95 | 3.00 | 20.19 | 11.67")
        + RUN.format(base=BASE, b_step=928.4, b="6.69 | 7.02 | 2.51 | 6.55 | 22.78 | 12.44", r_step=803.8,
                     r="4.97 | 6.60 | 3.74 | 3.02 | 20.16 | 11.60"))
LAYER = "qkv=7.65,chain=7.63,o_proj=5.87,gate_up=21.44,down=13.47"


def test_runs_are_averaged_and_headers_skipped():
    m = parse_micro(TEXT)
    assert set(m) == {"reg", BASE, "tma 24x8K win6", "tma 24x8K win6 split"}
    assert m["reg"]["runs"] == 2 and m["reg"]["step"] == pytest.approx(929.4)
    assert m[BASE]["step"] == pytest.approx((927.3 + 928.4) / 2)
    assert m["tma 24x8K win6"]["attn"] == pytest.approx((6.28 + 6.60) / 2)


def test_projection_matches_the_hand_computation():
    r = project(parse_micro(TEXT), BASE, "tma 24x8K win6", parse_layer(LAYER), 1123.4, 16)
    # by hand: qkv 4.975 - 6.715; chain (6.44 + 3.845) - (7.015 + 2.515); o_proj 3.01 - 6.565;
    # gate/up 20.175 - 22.73; down 11.635 - 12.46
    want = {"qkv": -1.74, "chain": 0.755, "o_proj": -3.555, "gate_up": -2.555, "down": -0.825}
    assert r["delta"] == pytest.approx(want)
    assert r["per_layer"] == pytest.approx(-7.92)
    assert r["layer"] == pytest.approx(56.06) and r["projected_layer"] == pytest.approx(48.14)
    assert r["projected_step"] == pytest.approx(1123.4 - 16 * 7.92)
    assert r["micro_ratio"] == pytest.approx(803.2 / 927.85)


def test_cli_prints_the_projection_and_refuses_bad_input(tmp_path, capsys):
    f = tmp_path / "micro.txt"
    f.write_text(TEXT)
    assert main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "step 1123.4 -> 996.7 us per token" in out and "| chain | 7.63 | +0.76 |" in out
    with pytest.raises(SystemExit, match="no variant 'pump 24x8K win6'"):
        main([str(f), "--ring", "pump 24x8K win6"])
    with pytest.raises(SystemExit, match="lacks"):
        main([str(f), "--layer", "qkv=7.65"])
    with pytest.raises(SystemExit, match="not PHASE=US"):
        main([str(f), "--layer", "attention=7.6"])
