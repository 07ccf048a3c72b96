"""scripts/ncu_stalls.py: the stall summary of an ncu per-instruction CSV, on a hand-written three-instruction file."""
from __future__ import annotations

import gzip
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_stalls", ROOT / "scripts" / "ncu_stalls.py")
ncu_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_stalls)

CSV = '''"Kernel Name","amk_megakernel",
"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"
"0x10","      BAR.SYNC.DEFER_BLOCKING 0x0","7","7","0","7"
"0x20","      IMAD.U32 R8, R12, 0x10000, RZ","","1","12","1"
"0x30","      FFMA R1, R2, R3, R1","0","0","0","0"
'''


def test_summary_counts_reasons_and_ranks_instructions(tmp_path):
    p = tmp_path / "s.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(CSV)
    header, rows = ncu_stalls.load(str(p))
    assert header[:2] == ["Address", "Source"] and len(rows) == 3
    text = ncu_stalls.summarise(header, rows, top=2)
    lines = text.splitlines()
    assert lines[0] == "20 warp samples over 3 instructions"          # 7 + 1 + 12; "Not Issued" columns not added
    assert lines[1].split() == ["long_sb", "12", "60.0%"] and lines[2].split() == ["barrier", "8", "40.0%"]
    hot = lines[next(i for i, ln in enumerate(lines) if ln.startswith("top 2")) + 1:]
    assert len(hot) == 2
    assert "IMAD.U32" in hot[0] and "65.00%" in hot[0] and "long_sb 12, barrier 1" in hot[0]
    assert "BAR.SYNC" in hot[1] and "35.00%" in hot[1]
    assert not any("FFMA" in ln for ln in lines)                       # top 2 only
