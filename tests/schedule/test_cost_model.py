"""The cost model (schedule/cost_model.py): its simulator on hand-built programs against hand-computed times, and
its predictions against real H100 measurements:
* docs/measured_ab_h100.jsonl: the current kernel (tenth and eleventh sessions' A/B tables and benches, 38 timings);
  the constants were fitted on all but the eleventh-session groups, which are held out (and before the
  prefetch_depth 1 point was added: a known miss, predicted +2.8% vs measured +11.7%);
* the thirty-ninth session's split / placement A/Bs (T39_PAIRS below) and the early_kv 'ahead' A/Bs
  (AHEAD_PAIRS): directions only;
* docs/measured_configs_h100.jsonl: 35 timings of 26 llama-3.2-1b configs of the first two sessions' kernel (ranking
  only: that kernel was ~1.3-1.8x slower). Spearman is computed by the rank script's own code and cross-checked
  against a hand-computed tiny case."""
from __future__ import annotations

import dataclasses

import importlib.util
import json
import pathlib

import pytest

import schedule.cost_model as cm
from schedule.ir import (Buffer, BufferKind, Counter, DType, MegakernelProgram, MemSpace, TARGETS, Task, Wait)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rank = _script("cost_model_rank")
cal = _script("calibrate_cost_model")


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


# ---- the simulator on hand-built programs (numbers computed by hand from the Calib constants) -----------------

def _gemv_program(n_tasks: int, rows: int, k: int, waits_on_first: bool = False, wait_prefetch_kb: int = 0,
                  sms: int | None = None) -> MegakernelProgram:
    """n_tasks GEMV row tiles of y = W x (bf16 W [n_tasks*rows, k], fp32 x), task i on SM i (or all on one SM).
    waits_on_first: tasks 1.. wait on task 0's counter."""
    n = n_tasks * rows
    bufs = [Buffer(0, "x", BufferKind.ACTIVATION, DType.F32, (k,)),
            Buffer(1, "w", BufferKind.WEIGHT, DType.BF16, (n, k), "w", MemSpace.STREAM),
            Buffer(2, "y", BufferKind.ACTIVATION, DType.F32, (n,))]
    counters = [Counter(i, f"c{i}") for i in range(n_tasks)]
    tasks = []
    for i in range(n_tasks):
        waits = [Wait(0, 1)] if waits_on_first and i > 0 else []
        tasks.append(Task(i, "GEMV", [0, 1], [2], i, waits,
                          {"row_start": i * rows, "row_count": rows, "k": k, "n": n, "has_norm": 0, "has_bias": 0,
                           "has_residual": 0, "eps": 0.0}, sm=0 if sms == 1 else i, label=f"t{i}"))
    queues = [[t.id for t in tasks]] if sms == 1 else [[i] for i in range(n_tasks)]
    return MegakernelProgram({"model": "hand", "max_seq": 1}, TARGETS["h100"], bufs, counters, tasks, queues,
                             {"wait_prefetch_kb": wait_prefetch_kb, "prefetch_depth": 0, "threads_per_block": 512})


def test_flows_share_the_bandwidth_hand_checked():
    f = cm._Flows(bw=10.0, cap=8.0)            # bytes / us
    f.add(1, 100.0)
    f.add(2, 300.0)
    assert f.rate() == 5.0                     # two flows: 10 / 2 each, under the cap
    t, fid = f.next_end()
    assert (t, fid) == (pytest.approx(20.0), 1)
    f.advance(t)
    f.finish(fid)
    assert f.rate() == 8.0                     # alone: capped at 8, not 10
    t, fid = f.next_end()                      # 300 - 100 = 200 left at 8 B/us: 25 us more
    assert (t, fid) == (pytest.approx(45.0), 2)
    f.add(3, 50.0)
    f.advance(30.0)                            # 10 us at 5 B/us each: flow 3 has moved all its 50 bytes
    assert f.cancel(3) == pytest.approx(50.0)
    f.add(4, 80.0)
    f.advance(34.0)                            # 4 us at 5 B/us: flow 4 has moved 20 of its 80 bytes
    assert f.cancel(4) == pytest.approx(20.0)
    assert f.done_bytes(4) == pytest.approx(20.0) and f.rate() == 8.0   # stopped: flow 2 alone again


def test_one_gemv_task_costs_what_the_constants_say():
    c = cm.CALIB
    rows, k = 16, 2048
    prog = _gemv_program(1, rows, k)
    w_bytes, x_bytes = rows * k * 2, k * 4
    stream = w_bytes / (min(c.sm_gbps, TARGETS["h100"].hbm_gbps * c.bw_eff) * 1e3)
    by_hand = (c.entry_us + 2 * c.l2_us + c.hbm_us + x_bytes / (c.stage_gbps * 1e3)   # idle HBM: no load term
               + stream + c.tail_us + c.tail_frac * stream + c.signal_us + c.launch_us)
    assert cm.task_bytes(prog, prog.tasks[0], 0) == w_bytes
    assert cm.staged_bytes(prog, prog.tasks[0]) == x_bytes
    assert cm.predict_us(prog, ctx=0) == pytest.approx(by_hand, rel=1e-9)


def test_streams_share_the_hbm_and_one_sm_is_capped():
    c = cm.CALIB
    bw = TARGETS["h100"].hbm_gbps * c.bw_eff * 1e3       # bytes / us
    one = cm.simulate(_gemv_program(1, 256, 4096), ctx=0)
    many = cm.simulate(_gemv_program(132, 256, 4096), ctx=0)
    w = 256 * 4096 * 2
    s1 = one.end[0] - one.start[0]                        # streaming + tail + signal of the lone task
    assert s1 == pytest.approx(w / (c.sm_gbps * 1e3) * (1 + c.tail_frac) + c.tail_us + c.signal_us, rel=1e-6)
    s132 = many.end[0] - many.start[0]                    # 132 at once: each gets its share of the HBM
    share = min(bw / 132, c.sm_gbps * 1e3)
    assert share < c.sm_gbps * 1e3                        # (the H100 constants: the share binds, not the cap)
    assert s132 == pytest.approx(w / share * (1 + c.tail_frac) + c.tail_us + c.signal_us, rel=1e-6)


def test_wait_prefetch_moves_a_waiting_tasks_bytes_early():
    # task 1 (its own SM) waits for task 0; with wait_prefetch_kb its first 64 KB land in L2 meanwhile
    off = cm.simulate(_gemv_program(2, 64, 4096, waits_on_first=True, wait_prefetch_kb=0), ctx=0)
    on = cm.simulate(_gemv_program(2, 64, 4096, waits_on_first=True, wait_prefetch_kb=64), ctx=0)
    assert on.ready[1] == pytest.approx(off.ready[1], rel=0.05)     # both wait for task 0 (which streams a bit
    assert on.end[1] - on.ready[1] < off.end[1] - off.ready[1]      # slower while the prefetch shares the HBM)
    # with everything on one SM nothing waits on a counter, so nothing is prefetched: the same time either way
    seq_off = cm.predict_us(_gemv_program(2, 64, 4096, waits_on_first=True, sms=1), ctx=0)
    seq_on = cm.predict_us(_gemv_program(2, 64, 4096, waits_on_first=True, wait_prefetch_kb=64, sms=1), ctx=0)
    assert seq_on == pytest.approx(seq_off)


def test_wait_prefetch_next_moves_the_next_queued_tasks_bytes_early():
    # SM 1 runs tile 1 (waits for tile 0 on SM 0), then tile 2 (no wait): with wait_prefetch_next_kb the head of
    # tile 2 lands in L2 while tile 1 waits, so tile 2 streams less from HBM afterwards
    def prog(next_kb):
        p = _gemv_program(3, 64, 4096, waits_on_first=True)
        t2 = dataclasses.replace(p.tasks[2], waits=[], sm=1)
        return MegakernelProgram(p.meta, p.target, p.buffers, p.counters, [p.tasks[0], p.tasks[1], t2],
                                 [[0], [1, 2]], {**p.config, "wait_prefetch_next_kb": next_kb})
    off, on = cm.simulate(prog(0), ctx=0), cm.simulate(prog(256), ctx=0)
    assert on.ready[1] == pytest.approx(off.ready[1], rel=0.05)   # tile 1 still waits for tile 0
    assert on.start[2] < off.start[2] and on.end[2] < off.end[2]  # its first batch and the tile finish earlier
    same = cm.simulate(dataclasses.replace(prog(0), config={**prog(0).config, "wait_prefetch_pace_kb": 16}), ctx=0)
    assert same.end == off.end                                    # the pace is not modelled


def _with_prefetches(prog, pfs: list[dict], sm_queue: list[int]):
    """prog plus L2_PREFETCH tasks (params without delay_ns: 0) on one extra SM, queued as sm_queue says."""
    n = len(prog.tasks)
    tasks = [Task(n + k, "L2_PREFETCH", [1], [], -1, [], {"has_b": 0, "start_b": 0, "count_b": 0, "delay_ns": 0,
                                                              **pf}, sm=len(prog.queues), label=f"pf{k}")
             for k, pf in enumerate(pfs)]
    return MegakernelProgram(prog.meta, prog.target, prog.buffers, prog.counters, prog.tasks + tasks,
                             prog.queues + [sm_queue], prog.config)


@pytest.mark.parametrize("delay_ns", [0, 1500])
def test_l2_prefetch_requests_go_out_after_its_delay(delay_ns):
    # an L2_PREFETCH task on SM 2 covering the rows of GEMV tile 1 (SM 1, which waits for tile 0 on SM 0): it
    # ends entry + delay + its requests' drain from the SM after it is ready (hand-computed from the constants)
    c = cm.CALIB
    prog = _gemv_program(2, 64, 4096, waits_on_first=True)
    w = prog.buffers[1]
    nbytes = 64 * 4096 * w.dtype.nbytes   # tile 1's rows
    prog = _with_prefetches(prog, [{"start_a": 64 * 4096, "count_a": 64 * 4096, "delay_ns": delay_ns}], [2])
    assert w.kind == BufferKind.WEIGHT
    sim = cm.simulate(prog, ctx=0)
    drain = max(c.prefetch_issue_us, nbytes / (c.prefetch_drain_gbps * 1e3))
    assert sim.end[2] - sim.ready[2] == pytest.approx(c.entry_us + delay_ns / 1000 + drain, rel=1e-9)


def test_l2_prefetch_requests_of_one_sm_drain_in_turn():
    # two L2_PREFETCH tasks on one SM (each half of tile 1's rows): the SM is busy until a task's requests have left
    # it, so the second enters only then and ends its own drain later (docs/PERF.md, forty-first session: a second
    # prefetch task and the SM's next task waited behind the first's requests)
    c = cm.CALIB
    prog = _gemv_program(2, 64, 4096, waits_on_first=True)
    half = 32 * 4096
    prog = _with_prefetches(prog, [{"start_a": 64 * 4096, "count_a": half}, {"start_a": 96 * 4096, "count_a": half}],
                            [2, 3])
    sim = cm.simulate(prog, ctx=0)
    one = half * prog.buffers[1].dtype.nbytes / (c.prefetch_drain_gbps * 1e3)
    assert sim.end[2] - sim.ready[2] == pytest.approx(c.entry_us + one, rel=1e-9)
    assert sim.end[3] == pytest.approx(sim.end[2] + c.entry_us + one, rel=1e-9)


def test_deadlock_is_an_error_not_a_hang():
    prog = _gemv_program(2, 16, 256, waits_on_first=True)
    prog.tasks[0].waits = [Wait(1, 1)]            # task 0 waits on task 1, which waits on task 0
    with pytest.raises(ValueError, match="deadlocks"):
        cm.predict_us(prog, ctx=0)


# ---- the current kernel's measurements (docs/measured_ab_h100.jsonl) -------------------------------------------
# bounds a little above what CALIB reaches (docs/PERF.md, twelfth session), so a change that makes the model track
# the measurements worse fails here
BENCH_TOL, FIT_REL, HELD_REL, PAIRS_OK = 0.04, 0.023, 0.024, 26

@pytest.fixture(scope="module")
def current():
    recs = cal.load_records()
    return recs, cal.prepare_all(recs)


def test_predictions_track_the_current_kernels_measurements(current):
    """Calibrated on the tenth-session groups and the benches; the eleventh-session groups (e11-*) were held out
    of the fit (scripts/calibrate_cost_model.py --holdout e11-)."""
    recs, progs = current
    assert len(recs) == 49 and len({r["group"] for r in recs}) == 18
    pred = cal.predict_all(recs, progs, cm.CALIB)
    for r, p in zip(recs, pred):
        if r["group"].startswith("bench-"):
            assert abs(p / r["latency_us"] - 1) <= BENCH_TOL, (r["group"], p, r["latency_us"])
    # t13-*: placements with early KV copies, which the model does not know (next test)
    fitted = [i for i, r in enumerate(recs) if not r["group"].startswith(("e11-", "t13-"))]
    held = [i for i, r in enumerate(recs) if r["group"].startswith("e11-")]
    lf = cal.loss([recs[i] for i in fitted], [pred[i] for i in fitted])
    lh = cal.loss([recs[i] for i in held], [pred[i] for i in held])
    assert lf["rel"] <= FIT_REL and lh["rel"] <= HELD_REL, (lf, lh)
    assert lf["pairs_ok"] + lh["pairs_ok"] >= PAIRS_OK, (lf, lh)


def test_early_kv_placement_ranks_as_measured(current):
    """Thirteenth session (t13-* groups, not fitted): sm_assignment 'list_idle' with early KV copies measured
    0.7-3.4% faster than 'list' on the three llama presets. The model copies an early_kv task's KV history before
    its wait (thirty-ninth session; before, it predicted the idle placements 2-5% slower): every idle row is
    predicted faster than its model's 'list' row, and every row within BENCH_TOL."""
    recs, progs = current
    pred = cal.predict_all(recs, progs, cm.CALIB)
    rows = [(r, p) for r, p in zip(recs, pred) if r["group"].startswith("t13-idle-")]
    assert len(rows) == 8
    base = {r["model"]: p for r, p in rows if r["config"]["sm_assignment"] == "list"}
    assert len(base) == 3
    for r, p in rows:
        assert abs(p / r["latency_us"] - 1) <= BENCH_TOL, (r["group"], r["config"], p, r["latency_us"])
        if r["config"]["sm_assignment"] == "list_idle":
            assert p < base[r["model"]], (r["group"], r["config"], p, base[r["model"]])


# Thirty-ninth session (H100, docs/PERF.md; interleaved A/Bs on that session's kernel, ~8% faster than the one the
# constants were fitted on, so only the direction of each change is checked): (model, ctx, base config, variant
# config, the variant's measured change). Every pair moved the step by more than 1.5%.
T39_PAIRS = [
    ("qwen3-0.6b", 512, {"attn_splits": 4}, {"attn_splits": 8}, -0.017),
    ("qwen3-0.6b", 512, {"attn_splits": 4}, {"attn_splits": 2}, +0.042),
    ("qwen3-0.6b", 512, {"attn_splits": 4}, {"attn_splits": 16}, +0.094),     # 128 tasks: off the idle SMs
    ("qwen3-0.6b", 512, {"attn_splits": 4}, {"attn_splits": 4, "qkv_head_split": 4}, +0.078),   # 4 SMs idle
    ("qwen3-0.6b", 2048, {"attn_splits": 4}, {"attn_splits": 8}, -0.027),
    ("llama-3.2-1b", 512, {"attn_splits": 4}, {"attn_splits": 8}, +0.071),   # 64 tasks, 36 idle SMs
    ("llama-3.2-1b", 512, {"attn_splits": 4}, {"attn_splits": 1}, +0.049),
    ("llama-3.2-1b", 512, {"attn_splits": 4}, {"attn_splits": 4, "wait_prefetch_kb": 0}, +0.023),
]


def test_split_and_placement_changes_rank_as_measured():
    """The thirty-ninth session's split / placement A/Bs: the model moves each step the way the H100 did (the
    idle-SM placement and its early KV copies decide most of them: before the model copied early KV, the 16-split,
    qkv_head_split 4 and llama 8-split variants were predicted faster)."""
    pin = {"fold_qk_norm": True, "sm_assignment": "auto", "early_kv": "auto"}
    recs = [{"group": "t39", "model": m, "gpu": "h100", "ctx": ctx, "config": {**pin, **cfg}, "latency_us": 1.0,
             "latency_kind": "measured-gpu"} for m, ctx, a, b, _ in T39_PAIRS for cfg in (a, b)]
    pred = cal.predict_all(recs, cal.prepare_all(recs), cm.CALIB)
    for k, (m, ctx, a, b, change) in enumerate(T39_PAIRS):
        pa, pb = pred[2 * k], pred[2 * k + 1]
        assert (pb - pa) * change > 0, (m, ctx, a, b, change, pa, pb)



# early_kv 'ahead' against the auto hints, measured on an H100 (change of the step): qwen3-0.6b ctx 512 (fortieth
# session, pads 0,8), llama-3.2-1b ctx 512 (thirty-seventh); at ctx 8192 it measured equal once the stages were aligned
AHEAD_PAIRS = [("qwen3-0.6b", 512, {"attn_splits": 8}, +0.030), ("llama-3.2-1b", 512, {"attn_splits": 4}, +0.007)]


def test_early_kv_ahead_ranks_as_measured():
    """The task before an 'ahead' attention task issues that task's KV history as it starts, on the same SM as its
    own stream: the model adds the copies to that task's stream (they have landed when it ends), so 'ahead' is
    predicted slower than the auto hints at ctx 512, as measured, and within 1.5% of them at ctx 8192 (measured
    equal; the model started the copies after that stream before and predicted -4.7%); every issuing task streams
    longer than in the auto program."""
    pin = {"fold_qk_norm": True, "sm_assignment": "auto"}
    cases = [(m, ctx, cfg, ch) for m, ctx, cfg, ch in AHEAD_PAIRS] + [("llama-3.2-1b", 8192, {}, 0.0)]
    recs = [{"group": "ahead", "model": m, "gpu": "h100", "ctx": ctx, "config": {**pin, **cfg, "early_kv": ek},
             "latency_us": 1.0, "latency_kind": "measured-gpu"} for m, ctx, cfg, _ in cases for ek in ("auto", "ahead")]
    prep = cal.prepare_all(recs)
    pred = cal.predict_all(recs, prep, cm.CALIB)
    for k, (m, ctx, cfg, change) in enumerate(cases):
        pa, pb = pred[2 * k], pred[2 * k + 1]
        if change:
            assert (pb - pa) * change > 0, (m, ctx, change, pa, pb)
        else:
            assert abs(pb / pa - 1) < 0.015, (m, ctx, pa, pb)
    auto, ahead = (prep[cal.record_key(r)] for r in recs[:2])   # qwen3-0.6b ctx 512
    sa, sb = cm.simulate(auto), cm.simulate(ahead)
    issuers = [ahead.index[q[j - 1]] for q in ahead.program.queues for j in range(1, len(q))
               if ahead.early[ahead.index[q[j]]] == 2]
    assert issuers and all(sb.end[i] - sb.start[i] > sa.end[i] - sa.start[i] for i in issuers)


def test_early_kv_copies_shorten_the_hinted_attention_tasks():
    """llama-3.2-1b at ctx 512 (the auto placement: every attention task on an SM the QKV phase leaves idle, hinted):
    with the hint each attention task finds its KV history (32 KB, within EARLY_KV_BYTES) on chip, so it spends one
    L2 round trip less from entering its op to streaming and nothing more on the landed bytes; stripped of the hints
    the same program takes longer per task and per step."""
    from schedule.graph import load_model
    from schedule.lower import lower
    prog = lower(load_model("llama-3.2-1b", dtype="bf16", device="meta"), TARGETS["h100"], {}, max_seq=576)
    att = [i for i, t in enumerate(prog.tasks) if t.op in cm.ATTN_OPS]
    assert att and all(prog.tasks[i].params.get("early_kv") == 1 for i in att)
    bare = dataclasses.replace(prog, tasks=[dataclasses.replace(t, params={**t.params, "early_kv": 0})
                                            if t.op in cm.ATTN_OPS else t for t in prog.tasks])
    assert all(cm.task_bytes(prog, prog.tasks[i], 512) <= cm.EARLY_KV_BYTES for i in att)
    on, off = cm.simulate(prog, ctx=512), cm.simulate(bare, ctx=512)
    for i in att:
        assert on.start[i] - on.ready[i] < off.start[i] - off.ready[i] - 0.5 * cm.CALIB.l2_us, i
        assert on.end[i] - on.start[i] < off.end[i] - off.start[i], i
    assert on.step_us < off.step_us
