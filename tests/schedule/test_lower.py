"""Lowering structure: task/counter counts per config (hand-computed), fine-grained dependencies, queue order,
JSON round trip, and the full llama-3.2-1b program lowering + validating quickly."""
from __future__ import annotations

import time

import pytest

from schedule.graph import load_model
from schedule.ir import TARGETS, IRError, MegakernelProgram, ScheduleConfig, validate
from schedule.lower import lower
from tests.conftest import small_graph


def _ops(prog):
    return prog.stats()["ops"]


def test_task_counts_default_toy():
    # toy: hidden 96, inter 176, 2 layers, 6 heads / 2 kv, vocab 313
    g = load_model("toy")
    p = lower(g, TARGETS["h100"], ScheduleConfig(gemv_rows=16, mlp_rows=32, lm_head_rows=64, qkv_heads=1,
                                                 qkv_head_split=1, attn_splits=1))
    ops = _ops(p)
    assert ops["QKV_ROPE"] == 2 * (6 + 2 + 2)                  # per layer: 6 q heads + 2 k + 2 v
    assert ops["ATTN_DECODE"] == 2 * 2                          # per kv head
    assert ops["GEMV"] == 2 * (96 // 16 + 96 // 16) + 5         # o_proj + down per layer; lm head ceil(313/64)=5
    assert ops["GEMV_SILU_MUL"] == 2 * 6                        # ceil(176/32)
    assert ops["EMBED"] == 1 and ops["ARGMAX_PAIRS"] == 1 and "ARGMAX_PARTIAL" not in ops   # argmax_in_lm_head
    # counters: x0 + per layer (2 qkv groups + attn + xmid + h + x_next) + the LM-head tiles' pairs
    assert len(p.counters) == 1 + 2 * (2 + 4) + 1
    parts = lower(g, TARGETS["h100"], ScheduleConfig(gemv_rows=16, mlp_rows=32, lm_head_rows=64, qkv_heads=1,
                                                     qkv_head_split=1, attn_splits=1, argmax_in_lm_head=False))
    assert _ops(parts)["ARGMAX_PARTIAL"] == 5 and _ops(parts)["ARGMAX_MERGE"] == 1 and "ARGMAX_PAIRS" not in _ops(parts)
    assert len(parts.counters) == 1 + 2 * (2 + 4) + 5 + 1   # ... + one per LM-head tile + the candidates
    one = lower(g, TARGETS["h100"], ScheduleConfig(gemv_rows=16, mlp_rows=32, lm_head_rows=64, qkv_heads=1,
                                                   qkv_head_split=1, attn_splits=1, split_argmax=False))
    assert _ops(one)["ARGMAX"] == 1 and "ARGMAX_PARTIAL" not in _ops(one)
    assert len(one.counters) == 1 + 2 * (2 + 4) + 1   # ... + logits


def test_attention_waits_only_for_its_group():
    g = load_model("toy")
    p = lower(g, TARGETS["h100"], {"qkv_heads": 1, "qkv_head_split": 1, "attn_splits": 1})
    for t in p.tasks:
        if t.op == "ATTN_DECODE":
            (w,) = t.waits
            producers = [u for u in p.tasks if u.out_counter == w.counter]
            assert w.threshold == len(producers) == 3 + 2       # 3 q heads of the group + its K + its V
            assert all(u.op == "QKV_ROPE" for u in producers)
            g_head = t.params["kv_head"]
            assert {u.params["head_start"] // (3 if u.params["mode"] == 0 else 1) for u in producers} == {g_head}


def test_queues_are_topological_and_complete():
    p = lower(load_model("toy"), TARGETS["h100"], {"num_sms": 4, "sm_assignment": "list"})
    assert sorted(i for q in p.queues for i in q) == list(range(len(p.tasks)))
    for sm, q in enumerate(p.queues):
        assert q == sorted(q) and all(p.tasks[i].sm == sm for i in q)


def test_json_round_trip_is_exact():
    p = lower(small_graph("qwen2"), TARGETS["a100"], {"attn_splits": 2, "fuse_norm": False}, max_seq=16)
    text = p.to_json()
    q = MegakernelProgram.from_json(text)
    assert q.to_json() == text
    assert q.to_dict() == p.to_dict()


def test_format_major_mismatch_is_clear():
    d = lower(load_model("toy"), TARGETS["h100"], {}).to_dict()
    d["format_version"] = "2.0"
    with pytest.raises(IRError, match="format_version '2.0' is not compatible"):
        MegakernelProgram.from_dict(d)


def test_config_that_does_not_fit_target():
    with pytest.raises(IRError, match="num_sms: 200 exceeds the h100's 132 SMs"):
        lower(load_model("toy"), TARGETS["h100"], {"num_sms": 200})


def test_llama_1b_lowers_and_validates_fast():
    t0 = time.perf_counter()
    p = lower(load_model("llama-3.2-1b", dtype="bf16"), TARGETS["h100"], {})
    res = validate(p)
    dt = time.perf_counter() - t0
    assert res.ok, res.report()
    assert p.weight_bytes == 2_471_628_800
    assert len(p.tasks) > 5_000 and len(p.queues) == 132
    assert dt < 30, f"lower+validate took {dt:.1f} s"


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_attention_estimate_counts_its_split_of_the_cache(splits):
    """est_bytes of an attention task: its KV head's K and V rows for its share of the positions (hand-computed on
    the toy: head_dim 16, bf16 cache, max_seq 48), plus q (fp32) and the small vectors. All splits of one head
    together count the head's cache once, as one ATTN_DECODE does."""
    g = load_model("toy", dtype="bf16")
    S, hd, G = 48, 16, 3
    p = lower(g, TARGETS["h100"], ScheduleConfig(attn_splits=splits), max_seq=S)
    op = "ATTN_DECODE" if splits == 1 else "ATTN_PARTIAL"
    att = [t for t in p.tasks if t.op == op]
    assert att and all(t.params["n_splits"] == splits for t in att if op == "ATTN_PARTIAL")
    kv = 2 * hd * 2 * -(-S // splits)            # K and V rows: hd bf16 elements per position of the split
    # plus q (G * hd fp32), pos (4 B) and the output: G * hd fp32, or a partial row of G * (hd + 2) fp32
    out = 4 * G * hd if splits == 1 else 4 * G * (hd + 2)
    assert {t.est_bytes for t in att} == {kv + 4 * G * hd + 4 + out}
    assert splits * kv == 2 * hd * 2 * S       # the splits of a head count its cache once (S % splits == 0)


@pytest.mark.parametrize("split", [2, 4])
def test_qk_norm_head_split_lowers_to_raw_rows_and_qk_norm_tasks(split):
    """qwen3 (QK-norm) with qkv_head_split > 1 and fold_qk_norm off: the q / k tasks write RAW rows (no QK-norm,
    no RoPE) into q_raw / k_raw, one QK_NORM_ROPE task per KV group finishes q and the K cache row, and attention
    waits for it."""
    from vm.abi import QKV_MODE_RAW, QKV_MODE_V
    g = small_graph("qwen3")   # 2 layers, 6 heads / 2 kv, head_dim 16
    c = g.config
    p = lower(g, TARGETS["h100"], {"qkv_head_split": split, "attn_splits": 2, "fold_qk_norm": False}, max_seq=32)
    assert validate(p).ok
    qkv = [t for t in p.tasks if t.op == "QKV_ROPE"]
    assert len(qkv) == c.n_layers * (c.n_heads + 2 * c.n_kv_heads) * split
    assert all(t.params["pair_count"] == c.head_dim // 2 // split and not t.params["has_qknorm"] for t in qkv)
    assert {t.params["mode"] for t in qkv if t.label.split(".")[1][0] in "qk"} == {QKV_MODE_RAW}
    assert {t.params["mode"] for t in qkv if t.label.split(".")[1][0] == "v"} == {QKV_MODE_V}
    qkn = [t for t in p.tasks if t.op == "QK_NORM_ROPE"]
    assert len(qkn) == c.n_layers * c.n_kv_heads
    for t in qkn:   # waits for its group's QKV tiles; every attention task of the group waits for it
        l, g_ = int(t.label[1]), t.params["kv_head"]
        assert [p.counters[w.counter].name for w in t.waits] == [f"qkv{l}.g{g_}"]
        assert p.buffers[t.outputs[0]].name == f"q{l}" and p.buffers[t.outputs[1]].name == f"k_cache{l}"
        attn = [a for a in p.tasks if a.op == "ATTN_PARTIAL" and a.label.startswith(f"L{l}.attn[g{g_}.")]
        assert len(attn) == 2 and all([w.counter for w in a.waits] == [t.out_counter] for a in attn)
    whole = lower(g, TARGETS["h100"], {"qkv_head_split": 1}, max_seq=32)   # whole heads: QK-norm in the QKV tiles
    assert _ops(whole).get("QK_NORM_ROPE", 0) == 0
    assert all(t.params["has_qknorm"] == (t.params["mode"] != QKV_MODE_V) for t in whole.tasks if t.op == "QKV_ROPE")


@pytest.mark.parametrize("splits", [1, 3])
def test_fold_qk_norm_removes_the_qk_norm_tasks(splits):
    """fold_qk_norm (the default) on qwen3 with split QKV heads: no QK_NORM_ROPE task; every attention task reads
    its group's RAW q rows, the norm weight and inv_freq and waits for the group's QKV tiles itself; only the task
    whose keys end at pos (ATTN_DECODE, or the last split) also reads the RAW K row and writes the K cache. Models
    without QK-norm, and whole-head QKV tiles, lower exactly as without the knob."""
    g = small_graph("qwen3")   # 2 layers, 6 heads / 2 kv, head_dim 16
    c = g.config
    cfg = {"qkv_head_split": 2, "attn_splits": splits}
    p = lower(g, TARGETS["h100"], {**cfg, "fold_qk_norm": True}, max_seq=32)
    assert validate(p).ok and _ops(p).get("QK_NORM_ROPE", 0) == 0
    base = lower(g, TARGETS["h100"], {**cfg, "fold_qk_norm": False}, max_seq=32)
    assert _ops(base)["QK_NORM_ROPE"] == c.n_layers * c.n_kv_heads
    assert [t.params for t in lower(g, TARGETS["h100"], cfg, max_seq=32).tasks] == [t.params for t in p.tasks]
    assert len(p.tasks) == len(base.tasks) - c.n_layers * c.n_kv_heads
    name = lambda b: p.buffers[b].name  # noqa: E731
    att = [t for t in p.tasks if t.op in ("ATTN_DECODE", "ATTN_PARTIAL")]
    assert len(att) == c.n_layers * c.n_kv_heads * splits
    for t in att:
        l, g_ = int(t.label[1]), t.params["kv_head"]
        last = t.op == "ATTN_DECODE" or t.params["split"] == splits - 1
        assert t.params["qk_norm"] == 1 and t.params["append_k"] == int(last) and t.params["qk_eps"] == c.rms_eps
        assert [p.counters[w.counter].name for w in t.waits] == [f"qkv{l}.g{g_}"]
        assert name(t.inputs[0]) == f"q_raw{l}" and name(t.inputs[4]).endswith("q_norm.weight")
        if last:
            assert name(t.inputs[6]) == f"k_raw{l}" and name(t.inputs[7]).endswith("k_norm.weight")
            assert t.outputs[1] == t.inputs[1] and name(t.outputs[1]) == f"k_cache{l}"
        else:
            assert len(t.inputs) == 6 and len(t.outputs) == 1
    for other in (small_graph("llama-untied"), g):   # no QK-norm / whole heads: the knob changes nothing
        c2 = {"qkv_head_split": 2 if other is not g else 1, "attn_splits": splits}
        a = lower(other, TARGETS["h100"], {**c2, "fold_qk_norm": False}, max_seq=32)
        b = lower(other, TARGETS["h100"], {**c2, "fold_qk_norm": True}, max_seq=32)
        assert [(t.op, t.inputs, t.outputs, t.params) for t in a.tasks] == \
            [(t.op, t.inputs, t.outputs, t.params) for t in b.tasks]


def test_list_idle_puts_attention_on_the_sms_qkv_leaves_idle():
    """llama-3.2-1b on 132 SMs: 96 QKV tasks per layer (32 + 8 + 8 heads x 2 RoPE halves) leave 36 SMs idle in
    the QKV phase. 'list' (ties to the lowest SM index) queues the first attention tasks behind QKV tasks;
    'list_idle' (ties to the SM idle longest) puts all 32 attention tasks of 4 splits on SMs that run no QKV task
    of the layer, where they can load their KV history rows before their wait. Both programs validate."""
    g = load_model("llama-3.2-1b", dtype="bf16", device="meta")
    for policy, want_idle in (("list", False), ("list_idle", True)):
        p = lower(g, TARGETS["h100"], {"attn_splits": 4, "sm_assignment": policy}, max_seq=576)
        assert validate(p).ok
        for l in (0, 7, 15):
            qkv_sms = {t.sm for t in p.tasks if t.label.startswith(f"L{l}.") and t.op == "QKV_ROPE"}
            attn = [t for t in p.tasks if t.label.startswith(f"L{l}.") and t.op == "ATTN_PARTIAL"]
            assert len(qkv_sms) == 96 and len(attn) == 32
            on_idle = sum(t.sm not in qkv_sms for t in attn)
            assert on_idle == (32 if want_idle else 0), (policy, l, on_idle)


@pytest.mark.parametrize("model,ctx,policy,splits,hinted", [
    ("llama-3.2-1b", 512, "list_idle", 4, True),    # 96 QKV tasks leave 36 SMs: 8 x 4 attention tasks fit, 8 x 8 not
    ("llama-3.1-8b", 512, "list_idle", 4, True),
    ("llama-3.2-3b", 512, "list_idle", 4, True),    # 80 QKV tasks leave 52 (8 x 8 = 64 do not fit)
    ("qwen3-0.6b", 512, "list_idle", 8, True),     # 2 QKV tasks per head: 64 leave 68 (4 per head: 128 leave 4)
    ("qwen3-0.6b", 1984, "list_idle", 8, True),    # up to 2048 positions of KV cache
    ("qwen3-1.7b", 512, "list_idle", 4, True),     # the same 64 + 68, but 256 KiB QKV tasks: 8 measured slower
    ("llama-3.2-1b", 8192, "list", 16, False),      # long context: one wave of 16 splits per KV head
])
def test_auto_assignment_splits_and_early_kv_hints(model, ctx, policy, splits, hinted):
    """sm_assignment / attn_splits auto: 'list_idle' with the most of 8 and 4 splits whose attention tasks fit the
    SMs a layer's QKV tasks leave idle (8 only next to QKV tasks of at most 128 KiB), else 'list' with 8 (16 at
    long context) -- the same program as those values
    given explicitly; the early_kv hint is on every attention task of the idle placement and on none otherwise."""
    g = load_model(model, dtype="bf16", device="meta")
    auto = lower(g, TARGETS["h100"], {}, max_seq=ctx + 64)
    explicit = lower(g, TARGETS["h100"], {"sm_assignment": policy, "attn_splits": splits}, max_seq=ctx + 64)
    strip = lambda p: [(t.op, t.sm, t.params, t.waits) for t in p.tasks]  # noqa: E731
    assert strip(auto) == strip(explicit)
    att = [t for t in auto.tasks if t.op == "ATTN_PARTIAL"]
    assert len(att) == g.config.n_layers * g.config.n_kv_heads * splits
    assert {t.params.get("early_kv", 0) for t in att} == {int(hinted)}
    if hinted:   # every hinted task sits on an SM that runs no QKV task of its layer
        for l in range(g.config.n_layers):
            qkv_sms = {t.sm for t in auto.tasks if t.label.startswith(f"L{l}.") and t.op == "QKV_ROPE"}
            assert not {t.sm for t in att if t.label.startswith(f"L{l}.")} & qkv_sms


@pytest.mark.parametrize("policy", ["list", "lpt", "round_robin"])
def test_early_kv_knob_overrides_the_estimate(policy):
    """early_kv 'on' hints every attention task and 'off' none, whatever the placement; 'auto' hints none under
    these policies for llama-3.2-1b at ctx 8192 ('list': the tasks sit behind QKV tasks; 'lpt' / 'round_robin'
    make no estimate); 'ahead' gives the hint 2 to the attention tasks queued right behind a weight tile (nine in
    ten under 'list') and none to the others. The hint changes no placement, wait or other param, and every
    program validates."""
    g = load_model("llama-3.2-1b", dtype="bf16", device="meta")
    progs = {v: lower(g, TARGETS["h100"], {"sm_assignment": policy, "early_kv": v}, max_seq=8192 + 64)
             for v in ("auto", "on", "off", "ahead")}
    hint = lambda p: [t.params.get("early_kv", 0) for t in p.tasks if t.op == "ATTN_PARTIAL"]  # noqa: E731
    hints = {v: set(hint(p)) for v, p in progs.items()}
    assert hints["on"] == {1} and hints["off"] == {0} and hints["auto"] == {0} and hints["ahead"] == {0, 2}
    if policy == "list":
        assert hint(progs["ahead"]).count(2) >= len(hint(progs["ahead"])) * 9 // 10
    strip = lambda p: [(t.op, t.sm, {k: v for k, v in t.params.items() if k != "early_kv"}, t.waits)  # noqa: E731
                       for t in p.tasks]
    assert strip(progs["on"]) == strip(progs["off"]) == strip(progs["auto"]) == strip(progs["ahead"])
    assert all(validate(p).ok for p in progs.values())


@pytest.mark.parametrize("other", [{"fuse_residual": False}, {"o_proj_by_group": True}])
def test_fuse_down_acts_only_with_whole_o_proj_rows(other):
    """fuse_down seeds x_{l+1} from o_proj's fused residual rows: without them (as for qkv_head_split's
    conditions) the knob has no effect and the down tiles stay; the program is the one without the knob."""
    toy = load_model("toy")
    got = lower(toy, TARGETS["h100"], {"fuse_down": True, **other})
    want = lower(toy, TARGETS["h100"], {"fuse_down": False, **other})
    assert not any(t.op == "GEMV_SILU_MUL_DOWN" or t.params.get("has_copy") for t in got.tasks)
    assert [(t.op, t.label, t.params) for t in got.tasks] == [(t.op, t.label, t.params) for t in want.tasks]
