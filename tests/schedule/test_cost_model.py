"""The cost model against real measurements: 35 timings of 26 distinct llama-3.2-1b configs on an H100
(docs/measured_configs_h100.jsonl, 2026-11-22). The model was calibrated on sweep A only; the other 26 are held out. Spearman is computed by
the rank script's own code and cross-checked against a hand-computed tiny case."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cost_model_rank", ROOT / "scripts" / "cost_model_rank.py")
rank = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rank)


def test_spearman_hand_checked():
    assert rank.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # ranks (1,2,3) vs (1,3,2): 1 - 6*sum(d^2)/(n(n^2-1)) = 1 - 6*2/24 = 0.5
    assert rank.spearman([1, 2, 3], [5, 9, 7]) == pytest.approx(0.5)


def _recs():
    """The measured records, each with predicted_us filled in once per distinct config (lowering is the slow part)."""
    recs = [json.loads(l) for l in (ROOT / "docs" / "measured_configs_h100.jsonl").read_text().splitlines() if l]
    pred: dict[str, float] = {}
    for r in recs:
        key = json.dumps(r["config"], sort_keys=True)
        if key not in pred:
            pred[key] = rank._predict(r, "llama-3.2-1b", "h100", 512)
        r["predicted_us"] = pred[key]
    return recs


def test_cost_model_ranks_measured_h100_configs():
    recs = _recs()
    assert len(recs) == 35 and len({json.dumps(r["config"], sort_keys=True) for r in recs}) == 26
    held_out = [r for r in recs if not r["run"].startswith("sweep-A")]
    assert len(held_out) == 26
    assert rank.rank_records(held_out, "llama-3.2-1b", "h100")["spearman"] >= 0.7
    assert rank.rank_records(recs, "llama-3.2-1b", "h100")["spearman"] >= 0.75
