"""The README's performance table against the bench records it cites (docs/bench_MODEL_GPU_ctxN_vNN.json): every
row's AMK latency, share of the floor and torch.compile latency must be the record's, the record must say the AMK
program passed its correctness gate, and the ratio must be compile / AMK. A row edited by hand without a record
behind it fails here."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (H100|H200) \| ([\w.-]+), (\d+)(, 8 steps per launch)? \| \**([\d.]+)\** \| ([\d.]+)[^|]* \| "
                 r"([\d.]+) \| ([\d.]+)x faster \| v(\d+)[^|]* \|$")


def table_rows() -> list[tuple]:
    text = (ROOT / "README.md").read_text()
    rows = [m.groups() for line in text.splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 10, "the README's performance table was not found (or its row format changed)"
    return rows


def test_row_pattern_reads_a_hand_written_row():
    m = ROW.match("| H200 | llama-3.2-3b, 512, 8 steps per launch | 2230.8 | 68.3 | 3049.8 | 1.37x faster | v52 |")
    assert m is not None
    assert m.groups() == ("H200", "llama-3.2-3b", "512", ", 8 steps per launch", "2230.8", "68.3", "3049.8", "1.37",
                          "52")


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}{'-x8' if r[3] else ''}")
def test_readme_row_matches_its_record(row):
    gpu, model, ctx, multi, amk_us, pct, compile_us, ratio, ver = row
    path = ROOT / "docs" / f"bench_{model}_{gpu.lower()}_ctx{ctx}_v{ver}.json"
    assert path.exists(), f"README row {row} cites {path.name}, which is not in docs/"
    rec = json.loads(path.read_text())
    assert rec["model"] == model and int(rec["ctx"]) == int(ctx)
    by_name = {r["name"]: r for r in rec["rows"]}
    amk_row = by_name["amk_megakernel_8_per_launch" if multi else "amk_megakernel"]
    gate = rec["amk_multistep" if multi else "amk"]
    assert gate["correct"] is True and gate["latency_kind"] == "measured-gpu"
    assert amk_row["us_per_token"] == pytest.approx(float(amk_us), abs=0.05)
    assert amk_row["pct_of_roofline"] == pytest.approx(float(pct), abs=0.05)
    compile_row = by_name["torch_compile_cuda_graph"]
    assert compile_row["us_per_token"] == pytest.approx(float(compile_us), abs=0.05)
    assert compile_row["us_per_token"] / amk_row["us_per_token"] == pytest.approx(float(ratio), abs=0.006)
