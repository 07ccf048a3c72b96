"""scripts/ab_builds.py's layout expansion (--pads): every variant in every code layout, and the per-variant mean
over its layouts, on hand-written rows (no GPU)."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ab_builds", ROOT / "scripts" / "ab_builds.py")
ab_builds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_builds)


def test_with_pads_adds_the_pad_to_each_variants_own_flags():
    out = ab_builds.with_pads(['base={}', 'f0={"nvcc": "-DAMK_ATTN_FAST=0", "attn_splits": 2}'], [0, 4, 12])
    names = [v.partition("=")[0] for v in out]
    assert names == ["base@0", "base@4", "base@12", "f0@0", "f0@4", "f0@12"]
    cfgs = [json.loads(v.partition("=")[2]) for v in out]
    assert cfgs[0] == {}                                                   # pad 0: the variant's own build
    assert cfgs[2] == {"nvcc": "-DAMK_LAYOUT_PAD=12"}
    assert cfgs[4] == {"nvcc": "-DAMK_ATTN_FAST=0 -DAMK_LAYOUT_PAD=4", "attn_splits": 2}  # schedule keys kept


def test_layout_means_average_each_variants_timed_layouts():
    rows = {"base@0": {"median_us": 1162.4}, "base@4": {"median_us": 1151.4}, "base@8": {"median_us": 1180.6},
            "f0@0": {"median_us": 1161.0}, "f0@4": {"error": "BuildError: x"}, "f0@8": {"median_us": 1171.0}}
    means = ab_builds.layout_means(rows)
    assert [m[0] for m in means] == ["base", "f0"]
    name, mean, lo, hi, k = means[0]
    assert mean == pytest.approx((1162.4 + 1151.4 + 1180.6) / 3) and (lo, hi, k) == (1151.4, 1180.6, 3)
    assert means[1][1:] == (pytest.approx(1166.0), 1161.0, 1171.0, 2)     # the untimed layout is left out
