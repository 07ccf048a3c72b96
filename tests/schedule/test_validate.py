"""schedule/validate.py: each contract violation is rejected with the task (id + opcode) and buffer/counter named;
valid hand-built and lowered programs pass; garbage never raises; a dropped wait in a lowered toy program is
rejected by validate() and really breaks the reference VM (NaN or a mismatch in some legal order). The race,
KV-step and accumulation rules (schedule/validate_races.py) are tested in test_validate_races.py."""
from __future__ import annotations

import json
import random

import pytest
import torch

from schedule.adversarial import N, NW, SRC, add_task, clone, gemv_task, norm_task
from schedule.ir import TARGETS, Buffer, BufferKind, DType, ScheduleConfig, Task, Wait, topological_order
from schedule.validate import ValidationResult, happens_before_edges, validate
from vm.abi import MAX_WAITS

from tests.schedule.validate_helpers import A0, A1, OUT, chain, prog, rejected, toy  # noqa: F401 (toy: fixture)


# -- valid programs ------------------------------------------------------------------------------------------
def test_valid_chain_passes_with_stats():
    r = validate(chain())
    assert r.ok, r.report()
    assert r.errors == []
    assert r.stats["tasks"] == 3 and r.stats["counters"] == 2 and r.stats["critical_path_tasks"] == 3
    assert "OK" in r.report()


def test_accepts_dict_and_json_text():
    p = chain()
    assert validate(p.to_dict()).ok
    assert validate(p.to_json()).ok


def test_same_sm_needs_no_wait_and_disjoint_tiles_may_run_unordered():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0),
              add_task(1, A0, A0, A1, sm=0),                          # ordered by queue order
              gemv_task(2, SRC, OUT, 0, 4, out=1, sm=1),              # two disjoint tiles of out, no order
              gemv_task(3, SRC, OUT, 4, 4, out=1, sm=2)], 2)
    assert validate(p).ok, validate(p).report()


def test_happens_before_edges_and_topological_order():
    p = chain()
    assert happens_before_edges(p) == [(0, 1), (0, 2), (1, 2)]
    assert topological_order(p) == [0, 1, 2]


# -- deadlocks -------------------------------------------------------------------------------------------------
def test_cycle_names_a_task_on_it():
    p = prog([add_task(0, SRC, SRC, A0, waits=[(1, 1)], out=0, sm=0),
              add_task(1, SRC, SRC, A1, waits=[(0, 1)], out=1, sm=1),
              norm_task(2, SRC, OUT, sm=2)], 2)
    text = rejected(p, "cycle", "task 0 (ADD)", "task 1 (ADD)")
    assert "counter 0" in text and "counter 1" in text


def test_threshold_above_producer_count_never_satisfied():
    p = chain()
    p.tasks[1].waits[0].threshold = 2
    rejected(p, "task 1 (ADD)", "counter 0", "never satisfied")


def test_threshold_below_producer_count_is_under_counted():
    p = prog([add_task(0, SRC, SRC, A0, 0, 4, out=0, sm=0),
              add_task(1, SRC, SRC, A0, 4, 4, out=0, sm=1),
              norm_task(2, A0, OUT, waits=[(0, 1)], sm=2)], 1)
    rejected(p, "task 2 (RMSNORM)", "under-counted wait", "counter 0")


def test_zero_threshold_rejected():
    p = chain()
    p.tasks[1].waits[0].threshold = 0
    rejected(p, "task 1 (ADD)", "threshold 0")


def test_wait_on_counter_nobody_signals():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), norm_task(1, A0, OUT, waits=[(0, 1), (1, 1)], sm=1)], 2)
    rejected(p, "task 1 (RMSNORM)", "counter 1", "no task signals")


def test_wait_on_own_out_counter():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), norm_task(1, A0, OUT, waits=[(1, 1)], out=1, sm=1)], 2)
    rejected(p, "task 1 (RMSNORM)", "its own out_counter", "deadlock")


def test_queue_waiting_on_its_own_later_work():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), norm_task(1, A0, OUT, waits=[(0, 1)], sm=0)], 1)
    p.queues[0] = [1, 0]                                                # the waiter is queued first
    rejected(p, "SM 0 queue", "task 1 (RMSNORM)", "task 0 (ADD)", "queued later", "counter 0")


# -- integrity, arity, params, ABI ---------------------------------------------------------------------------------
def test_out_of_range_buffer_id():
    p = chain()
    p.tasks[1].inputs[1] = 99
    rejected(p, "task 1 (ADD)", "buffer id 99 out of range")


def test_out_of_range_counter_ids():
    p = chain()
    p.tasks[1].waits.append(Wait(7, 1))
    p.tasks[0].out_counter = 5
    rejected(p, "task 1 (ADD): waits on counter 7 out of range", "task 0 (ADD): out_counter 5 out of range")


def test_too_many_inputs():
    p = chain()
    p.tasks[1].inputs.append(A0)
    rejected(p, "task 1 (ADD)", "3 inputs", "takes 2")


def test_optional_input_flags_change_arity():
    p = prog([gemv_task(0, SRC, OUT, out=0)], 1)
    p.tasks[0].params["has_norm"] = 1                                   # now needs a norm_w input
    p.tasks[0].params["eps"] = 1e-5
    rejected(p, "task 0 (GEMV)", "2 inputs", "takes 3")
    p.tasks[0].inputs.append(NW)
    assert validate(p).ok, validate(p).report()


def test_missing_param():
    p = chain()
    del p.tasks[1].params["count"]
    rejected(p, "task 1 (ADD)", "missing int param 'count'")


def test_missing_float_param_and_non_numeric_params():
    p = chain()
    del p.tasks[2].params["eps"]
    p.tasks[0].params["start"] = "0"
    rejected(p, "task 2 (RMSNORM)", "missing float param 'eps'", "task 0 (ADD)", "'start'")


def test_int_params_must_fit_int32():
    p = chain()
    p.tasks[0].params["count"] = 2 ** 31
    rejected(p, "task 0 (ADD)", "not an int32")


def test_unknown_opcode():
    p = chain()
    p.tasks[1].op = "FROBNICATE"
    rejected(p, "task 1", "unknown opcode 'FROBNICATE'")


def test_too_many_waits_abi_cap():
    tasks = [add_task(k, SRC, SRC, A0 if k == 0 else A1, k, 1, out=k, sm=k % 4) for k in range(MAX_WAITS + 1)]
    tasks.append(norm_task(MAX_WAITS + 1, SRC, OUT, waits=[(k, 1) for k in range(MAX_WAITS + 1)], sm=0))
    rejected(prog(tasks, MAX_WAITS + 1), f"task {MAX_WAITS + 1} (RMSNORM)", "ABI cap")


def test_range_outside_buffer():
    p = chain()
    p.tasks[0].params.update(start=6, count=4)
    rejected(p, "task 0 (ADD)", "[6, 10)", "'a0'", "outside its 8 elements")


def test_write_to_read_only_buffer():
    p = chain()
    p.tasks[0].outputs = [SRC]
    rejected(p, "task 0 (ADD)", "buffer 0 'src' (io_input)", "read-only")


def test_shape_sanity_gemv_k():
    p = chain()
    p.buffers = list(p.buffers) + [Buffer(7, "w2", BufferKind.WEIGHT, DType.F32, (N, 4), "w2")]
    p.tasks[2] = gemv_task(2, A1, OUT, waits=[(1, 1)])
    p.tasks[2].inputs[1] = 7
    rejected(p, "task 2 (GEMV)", "shape (8, 4) != (n, k)")


def test_queue_integrity():
    p = chain()
    p.queues = [[0, 2], [1, 2]]
    rejected(p, "task 2 (RMSNORM) is queued twice")
    p = chain()
    p.queues = [[0], [1]]
    rejected(p, "task 2 (RMSNORM) is in no queue")
    p = chain()
    p.tasks[1].sm = 0
    rejected(p, "task 1 (ADD): task.sm = 0 but it is queued on SM 1")
    p = chain()
    p.queues += [[] for _ in range(p.target.sm_count)]
    rejected(p, "queues but target", "co-resident")


def test_ids_must_equal_positions():
    p = chain()
    p.tasks[1].id = 5
    p.buffers[3] = Buffer(9, "a0", BufferKind.ACTIVATION, DType.F32, (N,))
    rejected(p, "task 1: id 5 != its position 1", "id 9 != its position 3")


def test_report_lists_every_error():
    p = chain()
    p.tasks[1].waits = []
    p.tasks[0].inputs[0] = 42
    r = validate(p)
    rep = r.report()
    assert rep.startswith("REJECTED") and all(e in rep for e in r.errors)
    assert r.stats["error_kinds"]


# -- garbage never raises ------------------------------------------------------------------------------------------
def _junk(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "none", "bool"] + (["list", "dict"] if depth < 4 else [])
    k = rng.choice(kinds)
    if k == "int":
        return rng.choice([0, -1, 1, 2 ** 40, -(2 ** 63), rng.randint(-5, 5)])
    if k == "float":
        return rng.choice([0.5, -1e300, float("nan"), float("inf")])
    if k == "str":
        return rng.choice(["", "tasks", "GEMV", "1.0", "\x00"])
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["format_version", "tasks", "buffers", "queues", "counters", "target", "meta", "id", "op", "x"]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 5))}


@pytest.mark.parametrize("junk", [None, [], {}, {"tasks": 5}, "not json", 3.5, b"\xff", object(),
                                  {"format_version": "1.0", "tasks": [None], "buffers": "x"}])
def test_garbage_is_rejected_not_raised(junk):
    r = validate(junk)
    assert not r.ok and r.errors


def test_random_nested_junk_never_raises():
    rng = random.Random(1)
    for _ in range(300):
        j = _junk(rng)
        merged = isinstance(j, dict) and rng.random() < 0.5
        if merged:          # junk over a valid program's fields: may still be valid (e.g. only "meta" changed)
            j = {**chain().to_dict(), **j}
        r = validate(j)
        assert isinstance(r, ValidationResult) and (merged or not r.ok)
        assert r.ok == (not r.errors)


def test_garbage_inside_a_program_object_never_raises():
    cases = []
    for attr, val in [("inputs", "ab"), ("waits", [5]), ("params", None), ("out_counter", 1.5), ("sm", None),
                      ("op", 7), ("outputs", [True])]:
        p = chain()
        setattr(p.tasks[1], attr, val)
        cases.append(p)
    p = chain()
    p.buffers[3] = None
    cases.append(p)
    p = chain()
    p.queues = None
    cases.append(p)
    p = chain()
    p.buffers[3] = Buffer(3, "a0", "bogus", DType.F32, (N,))
    cases.append(p)
    for p in cases:
        r = validate(p)
        assert not r.ok and r.errors


# -- lowered programs ----------------------------------------------------------------------------------------------
TOY_CONFIGS = [dict(), dict(num_sms=1), dict(num_sms=8, sm_assignment="round_robin", attn_splits=3),
               dict(num_sms=5, fuse_norm=False, fuse_residual=False, sm_assignment="lpt"),
               dict(num_sms=16, gemv_rows=4, mlp_rows=8, lm_head_rows=16, qkv_heads=2),
               dict(num_sms=7, attn_splits=64, qkv_heads=4),
               dict(num_sms=6, attn_splits=3, fuse_attn_merge=True, fuse_residual=False),
               dict(num_sms=6, fuse_down=True, mlp_rows=8)]


@pytest.mark.parametrize("cfg", TOY_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_lowered_toy_programs_pass(toy, cfg):
    from schedule.lower import lower
    p = lower(toy, TARGETS["h100"], ScheduleConfig(**cfg), max_seq=64)
    r = validate(p)
    assert r.ok, r.report()
    assert r.stats["tasks"] == len(p.tasks) and r.stats["critical_path_tasks"] >= 1
    assert validate(json.loads(p.to_json())).ok
    assert topological_order(p) is not None


def test_dropped_wait_in_lowered_toy_is_caught_and_really_breaks_the_vm(toy):
    from schedule.lower import lower
    from vm.reference_vm import ReferenceVM
    p = lower(toy, TARGETS["h100"], ScheduleConfig(num_sms=8, sm_assignment="round_robin", attn_splits=1), max_seq=64)
    ref = ReferenceVM(p, toy.weights, seed=0).step(5, 0)
    intact = ReferenceVM(p, toy.weights, seed=3).step(5, 0)
    assert torch.allclose(ref, intact, rtol=1e-5, atol=1e-6)          # any legal order gives the same logits
    picked = 0
    for op in ("ATTN_DECODE", "GEMV", "GEMV_SILU_MUL"):              # one dropped wait per opcode family
        t = next(t for t in p.tasks if t.op == op and t.waits)
        q = clone(p)
        q.tasks[t.id].waits = []
        r = validate(q)
        assert not r.ok and f"task {t.id} ({op}" in "\n".join(r.errors), r.report()
        broken = 0
        for seed in range(12):
            out = ReferenceVM(q, toy.weights, seed=seed, check=False).step(5, 0)
            broken += bool(torch.isnan(out).any()) or not torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
        assert broken, f"dropping the wait of task {t.id} ({op}) never showed in 12 random orders"
        picked += 1
    assert picked == 3


def test_every_error_names_the_task_opcode():
    """Spot check over many small mutants: every task-level error message carries 'task <id> (<OP>'."""
    from schedule.adversarial import generate
    import re
    for _, _, _, prog_ in generate(11, 300, toy_share=0.0):
        r = validate(prog_)
        for e in r.errors:
            for m in re.finditer(r"task (\d+)\b(?! is)", e):
                tid = int(m.group(1))
                if tid < len(prog_.tasks) and isinstance(prog_.tasks[tid], Task):
                    assert e[m.end():].startswith(" (") or e[m.end():].startswith(":"), e


@pytest.mark.parametrize("change,needle", [
    ({"x_splits": 2}, "merged x: partial buffer of"),             # the partials were written for 3 splits
    ({"x_group": 4}, "must be >= 1 and divide k"),                # 4 x 16 does not divide k = 96
    ({"x_head_dim": 0}, "must be >= 1 and divide k"),
    ({"x_splits": -1}, "x_splits -1 must be >= 0"),
    ({"x_splits": 0}, "!= x size"),                                # a plain x of k elements it is not
    ({"has_norm": 1}, "cannot be RMS-normalised"),
])
def test_merged_x_gemv_params_are_checked(toy, change, needle):
    """o_proj tiles that merge the split-KV partials (fuse_attn_merge) name the bad param and the buffer sizes."""
    from schedule.lower import lower
    base = lower(toy, TARGETS["h100"], ScheduleConfig(attn_splits=3, fuse_attn_merge=True), max_seq=64)
    assert validate(base).ok
    p = clone(base)
    o = next(t for t in p.tasks if ".o_proj[" in t.label)
    assert o.params["x_splits"] == 3 and p.buffers[o.inputs[0]].name.startswith("attn_partial")
    o.params.update(change)
    if change.get("has_norm"):
        o.inputs.insert(2, o.inputs[1])   # a norm weight slot (any buffer): the flag changes the arity
        o.params["eps"] = 1e-5
    rejected(p, f"task {o.id} (GEMV L0.o_proj", needle)


def test_qk_norm_rope_shapes_and_raw_mode_are_checked():
    """RAW QKV rows may not carry QK-norm, and QK_NORM_ROPE's raw rows must match the cache it finishes."""
    from schedule.lower import lower
    from tests.conftest import small_graph
    g = small_graph("qwen3")
    p = lower(g, TARGETS["h100"], {"qkv_head_split": 2, "fold_qk_norm": False}, max_seq=16)
    assert validate(p).ok
    raw = next(t for t in p.tasks if t.op == "QKV_ROPE" and t.params["mode"] == 3)
    raw.params["has_qknorm"] = 1
    raw.inputs.append(next(b.id for b in p.buffers if b.name.endswith("q_norm.weight")))
    rejected(p, f"task {raw.id} (QKV_ROPE", "mode RAW writes unnormalised rows")
    p = lower(g, TARGETS["h100"], {"qkv_head_split": 2, "fold_qk_norm": False}, max_seq=16)
    qkn = next(t for t in p.tasks if t.op == "QK_NORM_ROPE")
    qkn.inputs[1] = qkn.inputs[0]   # q_raw (6 heads) where k_raw (2 heads) belongs
    rejected(p, f"task {qkn.id} (QK_NORM_ROPE", "k_raw has 96 elements, want n_kv*head_dim = 32")
    p = lower(g, TARGETS["h100"], {"qkv_head_split": 2, "fold_qk_norm": False}, max_seq=16)
    qkn = next(t for t in p.tasks if t.op == "QK_NORM_ROPE")
    qkn.inputs[0] = next(b.id for b in p.buffers if b.name.endswith("q_proj.weight"))   # a bf16-able WEIGHT as q_raw
    rejected(p, f"task {qkn.id} (QK_NORM_ROPE", "q_raw, k_raw and q must be ACTIVATION buffers")
    p = lower(g, TARGETS["h100"], {"qkv_head_split": 2, "fold_qk_norm": False}, max_seq=16)
    qkn = next(t for t in p.tasks if t.op == "QK_NORM_ROPE")
    attn = next(t for t in p.tasks if t.op.startswith("ATTN_") and t.waits and t.waits[0].counter == qkn.out_counter
                and t.sm != qkn.sm)
    attn.waits = []   # attention on another SM no longer ordered after the task that writes its K row
    rejected(p, f"task {attn.id} (ATTN_", "k_cache0")


def test_folded_qk_norm_is_checked():
    """fold_qk_norm: exactly the attention task whose keys end at pos (the last split) finishes the K row (append_k),
    into its own k_cache buffer; a K row finished by another split, or by nobody, another buffer as k_out, and slots
    that do not match the flags are rejected naming the task."""
    from schedule.lower import lower
    from tests.conftest import small_graph
    g = small_graph("qwen3")
    cfg = {"qkv_head_split": 2, "attn_splits": 3, "fold_qk_norm": True}

    def prog():
        p = lower(g, TARGETS["h100"], cfg, max_seq=16)
        assert validate(p).ok
        return p, [t for t in p.tasks if t.op == "ATTN_PARTIAL" and t.label.startswith("L0.attn[g0.")]
    p, (s0, s1, s2) = prog()
    assert [t.params["append_k"] for t in (s0, s1, s2)] == [0, 0, 1] and not any(t.op == "QK_NORM_ROPE"
                                                                             for t in p.tasks)
    s2.params["append_k"] = 0   # nobody finishes the K row: the slots no longer match either
    s2.inputs, s2.outputs = s2.inputs[:6], s2.outputs[:1]
    rejected(p, f"task {s2.id} (ATTN_PARTIAL", "append_k must be 1 exactly on the task whose keys end at pos")
    p, (s0, s1, s2) = prog()
    s0.params["append_k"] = 1   # the first split finishing it (its keys never reach pos)
    s0.inputs, s0.outputs = s0.inputs + s2.inputs[6:], s0.outputs + s2.outputs[1:]
    rejected(p, f"task {s0.id} (ATTN_PARTIAL", "split 0 of 3 has append_k 1")
    p, (s0, s1, s2) = prog()
    s2.outputs[1] = s2.inputs[2]   # the V cache as k_out
    rejected(p, f"task {s2.id} (ATTN_PARTIAL", "k_out must be the task's k_cache buffer")
    p, (s0, s1, s2) = prog()
    s1.params["append_k"] = 1
    rejected(p, f"task {s1.id} (ATTN_PARTIAL", "with these flags takes")   # the arity names the missing slots
    p, (s0, s1, s2) = prog()
    s2.params["qk_norm"] = 0   # append_k without qk_norm
    rejected(p, f"task {s2.id} (ATTN_PARTIAL", "with these flags takes")


def test_early_kv_hint_must_be_0_1_or_2():
    """The early_kv hint of an attention task is optional (packed as 0); any value other than 0 / 1 / 2 is rejected,
    naming the task and the param. 2 (the task before it in its queue issues its KV history) needs a weight tile
    there: first in its queue, or behind another attention task, is rejected naming both."""
    from schedule.graph import load_model
    from schedule.lower import lower
    p = lower(load_model("toy", dtype="bf16"), TARGETS["h100"], {"sm_assignment": "list", "attn_splits": 2,
                                                                "early_kv": "off"}, max_seq=32)
    att = [t for t in p.tasks if t.op == "ATTN_PARTIAL"]
    assert att and validate(p).ok and not any("early_kv" in t.params for t in att)
    att[0].params["early_kv"] = 1
    assert validate(p).ok
    att[0].params["early_kv"] = 3
    rejected(p, f"task {att[0].id} (ATTN_PARTIAL {att[0].label})", "early_kv")
    att[0].params["early_kv"] = 0
    pos = {tid: (sm, j) for sm, q in enumerate(p.queues) for j, tid in enumerate(q)}
    ok = [t for t in att if pos[t.id][1] > 0 and p.tasks[p.queues[pos[t.id][0]][pos[t.id][1] - 1]].op == "QKV_ROPE"]
    assert ok
    ok[0].params["early_kv"] = 2
    assert validate(p).ok
    ok[0].params["early_kv"] = 0
    # 8 splits on 8 SMs: some attention tasks open a queue, others sit behind another attention task
    p = lower(load_model("toy", dtype="bf16"), TARGETS["h100"], {"sm_assignment": "list", "attn_splits": 8,
                                                                "num_sms": 8, "early_kv": "off"}, max_seq=32)
    att = [t for t in p.tasks if t.op == "ATTN_PARTIAL"]
    pos = {tid: (sm, j) for sm, q in enumerate(p.queues) for j, tid in enumerate(q)}
    first = [t for t in att if pos[t.id][1] == 0]
    behind = [t for t in att if pos[t.id][1] > 0 and p.tasks[p.queues[pos[t.id][0]][pos[t.id][1] - 1]].op == "ATTN_PARTIAL"]
    assert first and behind and validate(p).ok
    for t in first[:1]:
        t.params["early_kv"] = 2
        rejected(p, f"task {t.id} (ATTN_PARTIAL {t.label})", "first task of its queue")
        t.params["early_kv"] = 0
    for t in behind[:1]:
        t.params["early_kv"] = 2
        rejected(p, f"task {t.id} (ATTN_PARTIAL {t.label})", "cannot issue its KV history")
        t.params["early_kv"] = 0


def test_split_argmax_checks():
    """The split argmax validates as lowered; the validator rejects, naming the task: a partial that does not wait
    for its tile (a race on the logits), candidates beyond the logits, a float candidate buffer, and a merge that
    does not wait for every partial."""
    import copy

    from schedule.graph import load_model
    from schedule.ir import DType
    from schedule.lower import lower
    base = lower(load_model("toy"), TARGETS["h100"], {"lm_head_rows": 64, "num_sms": 4, "argmax_in_lm_head": False},
                 max_seq=16)
    part = [t for t in base.tasks if t.op == "ARGMAX_PARTIAL"]
    (merge,) = [t for t in base.tasks if t.op == "ARGMAX_MERGE"]
    assert len(part) == 5 and validate(base).ok
    p = copy.deepcopy(base)
    p.tasks[part[2].id].waits = []
    rejected(p, f"task {part[2].id}", "logits")
    p = copy.deepcopy(base)
    p.tasks[merge.id].params["n_cand"] = 400
    rejected(p, f"task {merge.id} (ARGMAX_MERGE", "cand")
    p = copy.deepcopy(base)
    p.buffers[merge.inputs[1]].dtype = DType.F32
    rejected(p, f"task {merge.id} (ARGMAX_MERGE", "cand i32")
    p = copy.deepcopy(base)
    p.tasks[merge.id].waits[0].threshold = 4
    rejected(p, f"task {merge.id}", "cand")


def test_argmax_in_lm_head_checks():
    """argmax_in_lm_head validates as lowered (5 LM-head tiles with has_argmax into one pairs buffer, one
    ARGMAX_PAIRS); the validator rejects, naming the task: a merge that does not wait for every tile (a race on the
    pairs), more pairs than the buffer holds, an i32 pairs buffer, a slot left out, a tile that accumulates, and
    two tiles writing the same slot."""
    import copy

    from schedule.graph import load_model
    from schedule.ir import DType
    from schedule.lower import lower
    base = lower(load_model("toy"), TARGETS["h100"], {"lm_head_rows": 64, "num_sms": 4, "argmax_in_lm_head": True},
                 max_seq=16)
    tiles = [t for t in base.tasks if t.label.startswith("lm_head[")]
    (merge,) = [t for t in base.tasks if t.op == "ARGMAX_PAIRS"]
    assert len(tiles) == 5 and [t.params["argmax_slot"] for t in tiles] == list(range(5)) and validate(base).ok
    assert not any(t.op in ("ARGMAX_PARTIAL", "ARGMAX_MERGE", "ARGMAX") for t in base.tasks)
    assert merge.waits[0].threshold == 5 and {t.out_counter for t in tiles} == {merge.waits[0].counter}
    p = copy.deepcopy(base)
    p.tasks[merge.id].waits[0].threshold = 4
    rejected(p, f"task {merge.id}", "pairs")
    p = copy.deepcopy(base)
    p.tasks[merge.id].params["n_cand"] = 6
    rejected(p, f"task {merge.id} (ARGMAX_PAIRS", "pairs")
    p = copy.deepcopy(base)
    p.buffers[merge.inputs[0]].dtype = DType.I32
    rejected(p, f"task {tiles[0].id} (GEMV", "pairs must be an f32 ACTIVATION")
    p = copy.deepcopy(base)
    del p.tasks[tiles[1].id].params["argmax_slot"]
    rejected(p, f"task {tiles[1].id} (GEMV", "argmax_slot")
    p = copy.deepcopy(base)
    p.tasks[tiles[2].id].params["accumulate"] = 1
    rejected(p, f"task {tiles[2].id} (GEMV", "has_argmax needs the rows' final values")
    p = copy.deepcopy(base)
    p.tasks[tiles[3].id].params["argmax_slot"] = 2
    rejected(p, "pairs")


@pytest.mark.parametrize("delay", [-1, 100_001])
def test_l2_prefetch_delay_out_of_range_is_rejected(toy, delay):
    # the kernel sleeps delay_ns without polling the abort flag: the validator bounds it (0..100 us)
    from schedule.lower import lower
    p = lower(toy, TARGETS["h100"], ScheduleConfig(mlp_prefetch_kb=64, mlp_prefetch_delay_ns=1500), max_seq=64)
    pf = [t for t in p.tasks if t.op == "L2_PREFETCH"]
    assert pf and validate(p).ok and all(t.params["delay_ns"] == 1500 for t in pf)
    pf[0].params["delay_ns"] = delay
    rejected(p, f"task {pf[0].id}", "L2_PREFETCH", f"delay_ns {delay} outside [0, 100000]")
    del pf[0].params["delay_ns"]   # programs written before the param existed: 0, no delay
    assert validate(p).ok
