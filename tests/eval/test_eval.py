"""eval/: dtype-aware logit comparison, roofline arithmetic (hand-checked), cost-model sanity."""
from __future__ import annotations

import math

import pytest
import torch

from eval.equivalence import compare_logits, describe_failures, describe_misses, summarize
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


def test_top1_misses_say_how_far_the_pick_trails():
    """A flipped near-tie (hand-made: the reference's top two 0.0075 apart, as the forty-third session's 16-step
    launch met) is reported with its gap inside the bf16 logit tolerance; a flip far outside it is not a tie."""
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref[17], ref[404] = 3.8856, 3.8781   # above every randn value: the top two
    out = ref.clone()
    out[404] = 3.8864   # the output's pick moves to 404; max |out - ref| = 0.0083
    r = compare_logits(out, ref, "bf16")
    assert r["passed"] and not r["top1_agree"]
    assert (r["ref_top1"], r["out_top1"]) == (17, 404)
    assert math.isclose(r["top1_gap"], 0.0075, abs_tol=1e-12)
    assert math.isclose(r["tol"], 1e-3 + 2e-2 * 3.8856, rel_tol=1e-12)
    s = summarize([compare_logits(ref, ref, "bf16"), r], ["step 0", "step 1 of the last launch"])
    assert s["top1_agreement"] == 0.5 and len(s["top1_misses"]) == 1
    msg = describe_misses(s)
    assert msg.startswith("top-1 differs at step 1 of the last launch: transformers' token 17 leads the program's 404 by "
                          "0.0075") and "(1 row of 2)" in msg and msg.endswith("a near-tie")
    far = ref.clone()
    far[int(ref.argmin())] = 10.0   # a token far behind in the reference is picked
    d = describe_misses(summarize([compare_logits(far, ref, "bf16")]))
    assert "step 0" in d and "beyond the logit tolerance" in d
    assert describe_misses(summarize([compare_logits(ref, ref, "f32")])) == ""
    nan = ref.clone()
    nan[0] = float("nan")   # no finite pick: counted as a top-1 miss, not described as one
    assert summarize([compare_logits(nan, ref, "f32")])["top1_misses"] == []


def test_failures_name_the_first_row_over_the_tolerance():
    """A row over the bf16 tolerance (hand-made: +0.03 x max|ref| on one logit, the tolerance 0.02 + 0.001 /
    max|ref|) is named with its error and the tolerance (the fifty-first session's llama-3.1-8b 8-per-launch row
    failed this way with every top-1 right, and the bench's note said only 'does not match'); a passing summary
    says nothing, and a top-1 miss is appended after it."""
    ref = torch.randn(500, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    scale = float(ref.abs().max())
    out = ref.clone()
    out[int(ref.argmin())] += 0.03 * scale   # the argmin stays far from the top: no top-1 change
    ok, bad = compare_logits(ref, ref, "bf16"), compare_logits(out, ref, "bf16")
    assert ok["passed"] and not bad["passed"] and bad["top1_agree"]
    assert math.isclose(bad["rel_tol"], 2e-2 + 1e-3 / scale, rel_tol=1e-12)
    s = summarize([ok, bad, bad], ["step 0", "step 1 of the last launch (position 4)", "step 2"])
    assert [o["where"] for o in s["over_tolerance"]] == ["step 1 of the last launch (position 4)", "step 2"]
    msg = describe_failures(s)
    assert msg.startswith("over the tolerance at 2 of 3 rows, first at step 1 of the last launch (position 4): "
                          "max rel err 0.03 against 0.02"), msg
    assert describe_failures(summarize([ok, ok])) == ""
    flip = ref.clone()
    flip[int(ref.argmin())] = 10.0   # far over the tolerance and the new top-1
    m = describe_failures(summarize([ok, compare_logits(flip, ref, "bf16")]))
    assert m.startswith("over the tolerance at 1 of 2 rows, first at step 1") and "; top-1 differs at step 1" in m


def test_roofline_llama_1b_hand_checked():
    p = lower(load_model("llama-3.2-1b", dtype="bf16"), TARGETS["h100"], {}, max_seq=1024)
    rl = roofline(p, ctx=512, bandwidth_gbps=3000.0)
    kv = 2 * 16 * 8 * 64 * 2 * 512                 # K and V, 16 layers, 8 kv heads, hd 64, bf16, 512 positions
    assert rl["kv_bytes"] == kv == 16_777_216
    assert rl["floor_us"] == pytest.approx((2_471_628_800 + kv) / 3000e9 * 1e6)   # ~829.5 us
    assert pct_of_roofline(1000.0, rl["floor_us"]) == pytest.approx(rl["floor_us"] / 10)


def test_bench_floors_report_copy_and_withhold_under_the_lowest():
    """The bench record's % of roofline is taken against the table's floor (bytes / measured copy bandwidth); a
    latency is withheld only under the lowest floor any known bandwidth gives (hand-checked bytes, as above)."""
    from eval.bench import floors
    p = lower(load_model("llama-3.2-1b", dtype="bf16", device="meta"), TARGETS["h100"], {}, max_seq=1024)
    total = 2_471_628_800 + 16_777_216
    nominal = total / (TARGETS["h100"].hbm_gbps * 1e9) * 1e6
    assert floors(p, 512) == pytest.approx((nominal, nominal))          # no measurement: the target's bandwidth
    report, withhold = floors(p, 512, {"read_gbps": 3096.1, "copy_gbps": 3006.7})
    assert report == pytest.approx(total / 3006.7e9 * 1e6)              # ~827.6 us: the bench table's floor
    assert withhold == pytest.approx(total / 3096.1e9 * 1e6)            # the read rate is the fastest here
    assert withhold < report
    slow = floors(p, 512, {"read_gbps": 2000.0, "copy_gbps": 1900.0})  # a slow measurement never raises the bar
    assert slow[0] == pytest.approx(total / 1900e9 * 1e6) and slow[1] == pytest.approx(nominal)


def test_cost_model_orders_obvious_cases():
    g = load_model("llama-3.2-1b", dtype="bf16")
    full = predict_us(lower(g, TARGETS["h100"], {}), ctx=512)
    few = predict_us(lower(g, TARGETS["h100"], {"num_sms": 33}), ctx=512)
    floor = roofline(lower(g, TARGETS["h100"], {}), ctx=512)["floor_us"]
    assert floor < full < few                      # 4x fewer SMs cannot be faster; nothing beats the floor
