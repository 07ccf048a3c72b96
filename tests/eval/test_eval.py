"""eval/: dtype-aware logit comparison, roofline arithmetic (hand-checked), cost-model sanity."""
from __future__ import annotations

import math

import pytest
import torch

from eval.equivalence import compare_logits, summarize
from eval.roofline import pct_of_roofline, roofline
from schedule.cost_model import predict_us
from schedule.graph import load_model
from schedule.ir import TARGETS
from schedule.lower import lower


def test_compare_logits_tolerances():
    ref = torch.randn(313, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scale = float(ref.abs().max())
    assert compare_logits(ref + 1e-7, ref, "f32")["passed"]
    bad = ref.clone()
    bad[5] += 1e-3 * scale
    r = compare_logits(bad, ref, "f32")
    assert not r["passed"] and math.isclose(r["max_rel_err"], 1e-3, rel_tol=1e-6)
    assert compare_logits(bad, ref, "bf16")["passed"]
    nan = ref.clone()
    nan[3] = float("nan")
    r = compare_logits(nan, ref, "f32")
    assert not r["passed"] and not r["top1_agree"]
    flip = ref.clone()
    i, j = int(ref.argmax()), int(ref.argmin())
    flip[i], flip[j] = ref[j], ref[i]
    assert not compare_logits(flip, ref, "bf16")["top1_agree"]
    s = summarize([compare_logits(ref, ref, "f32"), r])
    assert s["steps"] == 2 and not s["passed"] and s["top1_agreement"] == 0.5


def test_roofline_llama_1b_hand_checked():
    p = lower(load_model("llama-3.2-1b", dtype="bf16"), TARGETS["h100"], {}, max_seq=1024)
    rl = roofline(p, ctx=512, bandwidth_gbps=3000.0)
    kv = 2 * 16 * 8 * 64 * 2 * 512                 # K and V, 16 layers, 8 kv heads, hd 64, bf16, 512 positions
    assert rl["kv_bytes"] == kv == 16_777_216
    assert rl["floor_us"] == pytest.approx((2_471_628_800 + kv) / 3000e9 * 1e6)   # ~829.5 us
    assert pct_of_roofline(1000.0, rl["floor_us"]) == pytest.approx(rl["floor_us"] / 10)


def test_cost_model_orders_obvious_cases():
    g = load_model("llama-3.2-1b", dtype="bf16")
    full = predict_us(lower(g, TARGETS["h100"], {}), ctx=512)
    few = predict_us(lower(g, TARGETS["h100"], {"num_sms": 33}), ctx=512)
    floor = roofline(lower(g, TARGETS["h100"], {}), ctx=512)["floor_us"]
    assert floor < full < few                      # 4x fewer SMs cannot be faster; nothing beats the floor
