"""schedule/validate_races.py: unordered writers and readers, reads of scratch nobody wrote, outputs never
written, the KV cache's per-step rules (append before attention, one cache per layer) and accumulating writes
(GEMV accumulate, the fused MLP tiles seeded by o_proj's copy) -- each rejected with the task and buffer named."""
from __future__ import annotations

from schedule.adversarial import N, SRC, W, add_task, gemv_task, norm_task
from schedule.ir import TARGETS, Buffer, BufferKind, DType, ScheduleConfig
from schedule.validate import validate

from tests.schedule.validate_helpers import A0, A1, A2, OUT, chain, prog, rejected, toy  # noqa: F401 (toy: fixture)


# -- races ---------------------------------------------------------------------------------------------------------
def test_two_unordered_writers():
    p = prog([add_task(0, SRC, SRC, A0, 0, 6, out=0, sm=0),
              add_task(1, SRC, SRC, A0, 4, 4, out=0, sm=1),             # overlaps [4, 6) with task 0
              norm_task(2, A0, OUT, waits=[(0, 2)], sm=2)], 1)
    rejected(p, "unordered writers", "task 0 (ADD)", "task 1 (ADD)", "buffer 3 'a0'")


def test_read_not_ordered_after_write():
    p = chain()
    p.tasks[1].waits = []
    rejected(p, "read not ordered after its write", "task 1 (ADD)", "task 0 (ADD)", "'a0'")


def test_write_after_read_on_reused_scratch():
    # a0 written (SM 0), read on SM 1, then overwritten on SM 0 without waiting for the reader
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0),
              add_task(1, A0, A0, A1, waits=[(0, 1)], out=1, sm=1),
              add_task(2, SRC, SRC, A0, sm=0),
              add_task(3, A0, A1, A2, waits=[(1, 1)], sm=0),
              norm_task(4, A2, OUT, sm=0)], 2)
    rejected(p, "write-after-read", "task 2 (ADD)", "task 1 (ADD)", "'a0'")


def test_read_of_never_written_scratch():
    p = prog([norm_task(0, A0, OUT, sm=0)], 0)
    rejected(p, "task 0 (RMSNORM)", "'a0'", "NaN-poisoned")


def test_output_never_written():
    p = prog([add_task(0, SRC, SRC, A0, sm=0)], 0)
    rejected(p, "'out'", "never written")


def test_kv_cache_append_must_precede_attention():
    """Through the real access rules: a K append and an attention over the same head must be ordered."""
    from schedule.adversarial import toy_bases
    p = toy_bases([dict(num_sms=8, sm_assignment="round_robin", attn_splits=1)])[0]
    attn = next(t for t in p.tasks if t.op == "ATTN_DECODE")
    attn.waits = []
    rejected(p, f"task {attn.id} (ATTN_DECODE", "k_cache0")


def test_kv_cache_shared_by_two_layers_is_rejected(toy):
    """Ordered within the step, but the cache outlives it: layer 1's append clobbers layer 0's slot."""
    from schedule.lower import lower
    p = lower(toy, TARGETS["h100"], ScheduleConfig(num_sms=4, attn_splits=1), max_seq=64)
    k0, k1 = p.buffer("k_cache0").id, p.buffer("k_cache1").id
    for t in p.tasks:
        t.inputs = [k0 if b == k1 else b for b in t.inputs]
        t.outputs = [k0 if b == k1 else b for b in t.outputs]
    rejected(p, "(QKV_ROPE L0.k", "(QKV_ROPE L1.k", "'k_cache0' (kv_cache)", "lost to later steps")


def test_attention_reading_a_cache_not_appended_this_step_is_rejected(toy):
    from schedule.lower import lower
    p = lower(toy, TARGETS["h100"], ScheduleConfig(num_sms=4, attn_splits=1), max_seq=64)
    attn = next(t for t in p.tasks if t.op == "ATTN_DECODE" and t.label.startswith("L0."))
    attn.inputs[1] = p.buffer("k_cache1").id                          # layer 0 attention reads layer 1's keys
    rejected(p, f"task {attn.id} (ATTN_DECODE", "'k_cache1'", "append has not written")


# -- accumulating writes (GEMV accumulate: y += W x, atomic) ---------------------------------------------------
def _acc(tid, x, y, waits=(), out=-1, sm=0, rows=(0, N)):
    t = gemv_task(tid, x, y, rows[0], rows[1], waits, out, sm)
    t.params["accumulate"] = 1
    return t


def test_unordered_accumulations_into_one_range_are_not_a_race():
    """a0, a1 written on SM 0; two tasks on other SMs add W a0 into a1, unordered among themselves (their order
    only moves the rounding); the reader waits for both."""
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), add_task(1, SRC, SRC, A1, out=0, sm=0),
              _acc(2, A0, A1, waits=[(0, 2)], out=1, sm=1), _acc(3, A0, A1, waits=[(0, 2)], out=1, sm=2),
              norm_task(4, A1, OUT, waits=[(1, 2)], sm=3)], 2)
    r = validate(p)
    assert r.ok, r.report()


def test_accumulation_unordered_with_a_reader_is_a_race():
    # the reader waits only for the first accumulation: the second may add while it reads
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), add_task(1, SRC, SRC, A1, out=0, sm=0),
              _acc(2, A0, A1, waits=[(0, 2)], out=1, sm=1), _acc(3, A0, A1, waits=[(0, 2)], sm=2),
              norm_task(4, A1, OUT, waits=[(1, 1)], sm=3)], 2)
    rejected(p, "accumulates into", "task 3 (GEMV", "'a1'")


def test_accumulation_into_unwritten_scratch_and_before_the_initial_write():
    # nobody wrote a1 before the add: it would add to NaN-poisoned scratch
    rejected(prog([add_task(0, SRC, SRC, A0, out=0, sm=0), _acc(1, A0, A1, waits=[(0, 1)], out=1, sm=1),
                   norm_task(2, A1, OUT, waits=[(1, 1)], sm=0)], 2), "NaN-poisoned scratch", "task 1 (GEMV")
    # the plain write of a1 is not ordered before the add
    rejected(prog([add_task(0, SRC, SRC, A0, out=0, sm=0), add_task(1, SRC, SRC, A1, sm=2),
                   _acc(2, A0, A1, waits=[(0, 1)], out=1, sm=1), norm_task(3, A1, OUT, waits=[(1, 1)], sm=0)], 2),
             "accumulates into", "task 2 (GEMV")


def test_accumulate_needs_an_f32_activation_and_a_flag_of_0_or_1():
    p = prog([add_task(0, SRC, SRC, A0, out=0, sm=0), _acc(1, A0, OUT, waits=[(0, 1)], sm=1)], 1)
    rejected(p, "y must be an f32 ACTIVATION")
    p = chain()
    p.tasks[2] = gemv_task(2, A1, OUT, waits=[(1, 1)], sm=0)
    p.tasks[2].params["accumulate"] = 2
    rejected(p, "accumulate 2 must be 0 or 1")


def test_weight_column_slice_checked():
    p = chain()
    p.buffers[W] = Buffer(W, "w", BufferKind.WEIGHT, DType.F32, (N, N), "w", cols=(4, 3))
    rejected(p, "cols (4, 3) must be")
    p.buffers[W] = Buffer(W, "w", BufferKind.WEIGHT, DType.F32, (N, N), "w", cols=(4, N))
    assert validate(p).ok


# -- fused MLP tiles (fuse_down): o_proj's copy seeds x_{l+1}, the MLP tiles add into it ------------------------------
def _fused(toy):
    from schedule.lower import lower
    p = lower(toy, TARGETS["h100"], ScheduleConfig(num_sms=6, fuse_down=True, mlp_rows=8), max_seq=64)
    assert validate(p).ok
    o = [t for t in p.tasks if t.label.startswith("L0.o_proj")]
    mlp = [t for t in p.tasks if t.op == "GEMV_SILU_MUL_DOWN" and t.label.startswith("L0.")]
    assert o and len(mlp) >= 2 and all(t.params["has_copy"] == 1 for t in o)
    return p, o, mlp


def test_fused_mlp_tile_without_the_seeding_copy_adds_into_scratch(toy):
    p, o, mlp = _fused(toy)
    o[0].params["has_copy"] = 0   # x1's first rows are never written before the MLP tiles add into them
    o[0].outputs = o[0].outputs[:1]
    rejected(p, "NaN-poisoned scratch", "GEMV_SILU_MUL_DOWN", "'x1'")


def test_fused_mlp_tile_before_the_seeding_copy_is_a_race(toy):
    p, o, mlp = _fused(toy)
    mlp[0].waits = []   # may add into x1 before o_proj has written it
    rejected(p, "accumulates into", f"task {mlp[0].id} (GEMV_SILU_MUL_DOWN", "'x1'")


def test_fused_mlp_tile_shapes_and_copy_flags_checked(toy):
    p, o, mlp = _fused(toy)
    mlp[0].params["out_n"] -= 1
    rejected(p, "'w_down' shape", "(out_n, row_count)")
    p, o, mlp = _fused(toy)
    o[0].params["has_copy"] = 0   # the second output without the flag
    rejected(p, f"task {o[0].id} (GEMV", "outputs, opcode GEMV with these flags takes 1 (y)")
    p, o, mlp = _fused(toy)
    o[0].params["accumulate"], o[0].params["has_residual"] = 1, 0
    o[0].inputs = o[0].inputs[:2]
    rejected(p, "has_copy with accumulate")
