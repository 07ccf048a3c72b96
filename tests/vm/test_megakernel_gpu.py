"""The GPU megakernel VM against the CPU ReferenceVM (same program tables, same weights) on every build path and
knob that must leave results unchanged, and a decode loop with zero host syncs per token. The robustness contract
(traps, timeouts, bad inputs, layout drift) is tests/vm/test_megakernel_errors_gpu.py.

fp32: max|gpu - ref| <= 1e-5 * max|ref| per step; bf16: <= 2e-2 (K/V rounding may flip an ulp) and same top-1.
All tests carry @pytest.mark.cuda (skipped without a GPU by tests/conftest.py).
"""
from __future__ import annotations


import pytest
import torch

from schedule.graph import ModelConfig, ModelGraph, random_weights
from schedule.ir import TARGETS
from schedule.lower import lower
from tests.conftest import SMALL_CONFIGS, small_graph
from vm.reference_vm import ReferenceVM

pytestmark = pytest.mark.cuda

# Extra shapes on top of tests/conftest.py: scalar paths (K % 8 != 0, head_dim 10), G > 8, head_dim 128 / 256.
EXTRA = {
    "odd": ModelConfig("llama", 101, 90, 70, 2, 3, 1, 10, 1e-5, 10000.0, None, False, max_position=700),
    "wide-group": ModelConfig("llama", 257, 96, 128, 1, 12, 1, 8, 1e-5, 10000.0, None, True, max_position=700),
    "hd128": ModelConfig("qwen3", 300, 128, 256, 2, 4, 1, 128, 1e-6, 1e6, None, True, qk_norm=True,
                         max_position=700),
    "hd256": ModelConfig("llama", 211, 64, 96, 1, 8, 1, 256, 1e-5, 10000.0, None, False, max_position=700),
    # big enough for several weight-ring stages per task (QKV tile 256 KB in bf16, gate/up 128 KB, down 64 KB)
    "wide": ModelConfig("llama", 500, 1024, 2048, 1, 8, 2, 128, 1e-5, 10000.0, None, False, max_position=700),
    # 5 kv heads of one query head, head_dim 8: 3 splits give 5 x 3 x 10 = 150 partial floats (not a multiple of
    # 4), so o_proj merges them through its scalar copy path
    "merge-odd": ModelConfig("llama", 97, 40, 64, 1, 5, 5, 8, 1e-5, 10000.0, None, False, max_position=700),
}
CONFIGS = {
    "default": {"num_sms": 8},
    "split": {"attn_splits": 3, "fuse_norm": False, "fuse_residual": False, "gemv_rows": 4, "qkv_heads": 2,
              "num_sms": 16, "sm_assignment": "round_robin"},
    "lpt": {"lm_head_rows": 16, "mlp_rows": 8, "sm_assignment": "lpt", "num_sms": 5},
}


def graph(name: str, dtype: str = "f32", seed: int = 3) -> ModelGraph:
    if name in SMALL_CONFIGS:
        return small_graph(name, seed=seed, dtype=dtype)
    c = EXTRA[name]
    return ModelGraph(name, c, random_weights(c, dtype, seed), dtype)


def make(name="llama-untied", dtype="f32", cfg="default", max_seq=48, check=True, **kw):
    from vm.loader import MegakernelVM
    g = graph(name, dtype)
    prog = lower(g, TARGETS["h100"], CONFIGS[cfg], max_seq=max_seq)
    return g, prog, MegakernelVM(prog, g.weights, check=check, **kw)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def compare(vm, ref, steps, tol):
    """Run (token, pos) steps on both VMs; assert logits within tol and next_token == argmax."""
    worst = 0.0
    for tok, pos in steps:
        want = ref.step(tok, pos)
        got = vm.step(tok, pos).clone()
        assert torch.isfinite(got).all(), f"non-finite logits at pos {pos}"
        worst = max(worst, rel_err(got, want))
        assert worst <= tol, f"pos {pos}: rel err {worst:.3g} > {tol}"
        assert int(vm.next_token.item()) == int(torch.argmax(got).item())
        if tol >= 1e-3:
            assert int(torch.argmax(got)) == int(torch.argmax(want)) or \
                float(want.max() - want[int(torch.argmax(got))]) < 1e-2 * float(want.abs().max())
    return worst


def _path(path: str) -> dict:
    """Build variant: 'reg' = register streaming (default; sm_80 path), 'ring' = sm_90 bulk-copy weight ring."""
    return {"tma": path == "ring"}


_PRE_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9
needs_sm90 = pytest.mark.skipif(_PRE_SM90, reason="the weight ring needs sm_90+")
PATHS = ["reg", pytest.param("ring", marks=needs_sm90)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS) + sorted(EXTRA))
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_fp32_matches_reference(name, cfg, path):
    S = min(600, graph(name).config.max_position)
    g, prog, vm = make(name, "f32", cfg, max_seq=S, **_path(path))
    ref = ReferenceVM(prog, g.weights, seed=1)
    V = g.config.vocab
    # positions 0..3, then far positions (unwritten cache rows are zero in both VMs): several attention tiles
    steps = [(7 % V, 0), (100 % V, 1), (250 % V, 2), (3, 3), (11 % V, S // 2), (5, S - 1)]
    compare(vm, ref, steps, 1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["llama-untied", "qwen3", "odd", "hd128", "wide"])
def test_bf16_matches_reference(name, path):
    S = min(300, graph(name).config.max_position)
    g, prog, vm = make(name, "bf16", "split" if name == "qwen3" else "default", max_seq=S, **_path(path))
    ref = ReferenceVM(prog, g.weights, seed=2)
    compare(vm, ref, [(5, 0), (17, 1), (33, 2), (2, 3), (9, S - 1)], 2e-2)


def test_register_path_has_no_ring():
    g, prog, vm = make("wide", "bf16", "default", max_seq=16, tma=False)
    assert vm.ring_bytes == 0 and vm.n_streamed == 0


@needs_sm90
def test_ring_streams_on_sm90():
    g, prog, vm = make("wide", "bf16", "default", max_seq=16, **_path("ring"))
    # every GEMV-family task streams, except QKV tasks holding a slice of a head's RoPE pairs (two row ranges)
    assert vm.ring_bytes > 0 and vm.n_streamed == sum(
        t.op in ("GEMV", "GEMV_SILU_MUL") or (t.op == "QKV_ROPE" and not t.params.get("pair_count"))
        for t in prog.tasks)
    ref = ReferenceVM(prog, g.weights, seed=4)
    compare(vm, ref, [(5, 0), (17, 1), (3, 15)], 2e-2)
    a = vm.step(3, 2).clone()
    assert torch.equal(a, vm.step(3, 2))   # bit-identical reruns through the ring


@needs_sm90
def test_ring_with_fewer_stages_than_warps_in_flight(monkeypatch):
    """A ring of 3 x 8 KB stages: a gate/up stage of "wide" holds two row pairs, so the 16 warps' work items spread
    over 8 stages, more than the ring holds. A warp that asks for stage n + 3 while slot n % 3 still waits for stage n
    must wait for it (the producer's issued count), not take the slot's previous phase for its own: same logits as
    the ReferenceVM at bf16 tolerance, bit-identical reruns, no timeout."""
    monkeypatch.setenv("AMK_STAGES", "3")
    monkeypatch.setenv("AMK_STAGE_BYTES", "8192")
    monkeypatch.setenv("AMK_RING_WINDOW", "2")
    g, prog, vm = make("wide", "bf16", "default", max_seq=16, **_path("ring"))
    assert vm.ring_bytes == 3 * 8192 and vm.n_streamed > 0
    ref = ReferenceVM(prog, g.weights, seed=4)
    compare(vm, ref, [(5, 0), (17, 1), (3, 15)], 2e-2)
    a = vm.step(3, 2).clone()
    for _ in range(3):
        assert torch.equal(a, vm.step(3, 2))


@needs_sm90
@pytest.mark.parametrize("name,dtype,cfg", [("wide", "bf16", "default"), ("hd128", "bf16", "default"),
                                            ("llama-untied", "f32", "split")])
def test_ring_wg_is_bit_identical_to_the_ring(monkeypatch, name, dtype, cfg):
    """-DAMK_RING_WG=1 (vm/csrc/common.cuh): the ring's producer as a warpgroup handing registers to the compute
    warps with setmaxnreg (112 instead of 96). The same op code at more registers: logits bit-identical to the
    17-warp ring build's and within the dtype's tolerance of the ReferenceVM, reruns bit-identical, no hang (a
    wrong register pool would leave setmaxnreg.inc waiting). Written in the fifty-first session, before any GPU
    ran it."""
    g, prog, ring = make(name, dtype, cfg, max_seq=16, **_path("ring"))
    monkeypatch.setenv("AMK_NVCC_FLAGS", "-DAMK_RING_WG=1")
    wg = _same_bits_as(ring, lambda: make(name, dtype, cfg, max_seq=16, **_path("ring"))[2], g, prog,
                       [(5, 0), (17, 1), (3, 15)], dtype)
    assert wg.ring_bytes == ring.ring_bytes > 0 and wg.n_streamed == ring.n_streamed > 0


def _same_bits_as(base, build, g, prog, toks, dtype):
    """A build switch's VM (build(), called after the caller set AMK_NVCC_FLAGS) against `base`, the same program
    without the switch: logits bit-identical at every (token, pos) of toks, within the dtype's tolerance of the
    ReferenceVM after a reset, a rerun bit-identical. Returns the switch's VM."""
    want = [base.step(t, p).clone() for t, p in toks]
    vm = build()
    got = [vm.step(t, p).clone() for t, p in toks]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    vm.reset()
    compare(vm, ReferenceVM(prog, g.weights, seed=4), toks, 1e-5 if dtype == "f32" else 2e-2)
    a = vm.step(3, 2).clone()
    assert torch.equal(a, vm.step(3, 2))
    return vm


@pytest.mark.parametrize("name,dtype,cfg", [("llama-untied", "f32", {"num_sms": 8}),
                                            ("qwen3", "bf16", {"num_sms": 16, "attn_splits": 3, "early_kv": "on"}),
                                            ("wide", "bf16", {"num_sms": 12, "early_kv": "ahead", "attn_splits": 2}),
                                            ("merge-odd", "f32", {"num_sms": 16, "attn_splits": 3,
                                                                  "steps_per_launch": 2})])
def test_instr_ahead_is_bit_identical(monkeypatch, name, dtype, cfg):
    """-DAMK_INSTR_AHEAD=1 (vm/csrc/megakernel.cu): the next task's instruction lands in shared memory by cp.async
    (warp 0's lanes 1-27) while the current task runs -- beside the early-KV / KV-ahead copies of threads 32 and up
    and before the attention ops' own groups, whose wait counts must still hold. The same tasks in the same order:
    logits bit-identical to the default build (early KV on, KV ahead, split attention, two steps per launch),
    within tolerance of the ReferenceVM, reruns bit-identical. Written in the fifty-second session, before any GPU
    ran it."""
    from vm.loader import MegakernelVM
    g = graph(name, dtype)
    prog = lower(g, TARGETS["h100"], cfg, max_seq=40)
    base = MegakernelVM(prog, g.weights, check=True)
    monkeypatch.setenv("AMK_NVCC_FLAGS", "-DAMK_INSTR_AHEAD=1")
    # consecutive positions: a 2-step launch's greedy KV row is rewritten by the next step
    _same_bits_as(base, lambda: MegakernelVM(prog, g.weights, check=True), g, prog,
                  [(5, 0), (17, 1), (3, 2), (9, 3), (4, 4)], dtype)


_GEMV_FAMILY = ("GEMV", "GEMV_SILU_MUL", "QKV_ROPE")


@needs_sm90
@pytest.mark.parametrize("name", ["llama-untied", "qwen3", "odd", "wide"])
def test_preload_is_bit_identical_to_global_loads(name):
    """The whole-tile preload (preload.cuh) runs the same tile code over shared memory: logits are bit-identical
    with the preload off, with a cap that flags only some tasks (flagged and plain tasks interleave in one queue),
    and with a 160 KB cap; and they match the reference VM."""
    from vm.loader import MegakernelVM
    g, prog, vm0 = make(name, "f32", "split", max_seq=64, preload_kb=0)
    assert vm0.n_preloaded == 0 and vm0.preload_bytes == 0
    tiles = sorted(int(r["prefetch_bytes"].sum()) for r, t in zip(vm0.instrs_np, prog.tasks) if t.op in _GEMV_FAMILY)
    mid_kb = max(1, tiles[len(tiles) // 2] // 1024)
    vms = [MegakernelVM(prog, g.weights, preload_kb=kb) for kb in (mid_kb, 160)]
    n_family = sum(t.op in _GEMV_FAMILY for t in prog.tasks)
    if name == "odd":      # 360-byte rows are not 16-byte multiples: nothing may be preloaded
        assert all(v.n_preloaded == 0 for v in vms)
    else:
        assert 0 < vms[0].n_preloaded < n_family, (vms[0].n_preloaded, n_family, mid_kb)
        assert vms[1].n_preloaded == sum(1 for x in tiles if x <= 160 * 1024) > 0
        assert vms[1].preload_bytes >= vms[0].preload_bytes > 0
    ref = ReferenceVM(prog, g.weights, seed=5)
    for tok, pos in [(5, 0), (17, 1), (3, 2), (9, 63)]:
        want = ref.step(tok, pos)
        base = vm0.step(tok, pos).clone()
        assert rel_err(base, want) <= 1e-5
        for v in vms:
            assert torch.equal(v.step(tok, pos), base), f"preload {v.preload_bytes} B changed the logits at {pos}"


def test_f16_weights_run():
    g, prog, vm = make("llama-untied", "f16", "default")
    ref = ReferenceVM(prog, g.weights, seed=2)
    compare(vm, ref, [(5, 0), (17, 1)], 2e-2)


def test_reruns_are_bit_identical():
    g, prog, vm = make("qwen3", "bf16", "split")
    a = [vm.step(t, i).clone() for i, t in enumerate([3, 8, 13])]
    vm.reset()
    b = [vm.step(t, i).clone() for i, t in enumerate([3, 8, 13])]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("at,frm,spread", [("layer", "gate", False), ("qkv", "gate", False), ("attn", "gate", False),
                                           ("qkv", "both", False), ("qkv", "gate", True)])
def test_l2_prefetch_tasks_leave_results_bit_identical(at, frm, spread):
    from vm.loader import MegakernelVM
    g = graph("wide", "bf16")
    outs = []
    for kb in (0, 512, 64):
        # 2 kv heads x 2 splits leave half of the 8 SMs idle: the lowering emits prefetch tasks only then; spread:
        # on 16 SMs the 16 gate/up tiles' heads go to 10 tasks, 6 of them with a second range of the gate matrix
        prog = lower(g, TARGETS["h100"], {**CONFIGS["default"], "attn_splits": 2, "mlp_prefetch_kb": kb,
                                          "mlp_prefetch_at": at, "mlp_prefetch_from": frm,
                                          "mlp_prefetch_spread": spread, "num_sms": 16 if spread else 8},
                     max_seq=48)
        assert (kb > 0) == any(t.op == "L2_PREFETCH" for t in prog.tasks)
        assert not spread or kb == 0 or any("+[" in t.label for t in prog.tasks if t.op == "L2_PREFETCH")
        vm = MegakernelVM(prog, g.weights)
        outs.append(torch.stack([vm.step(3 + i, i).clone() for i in range(3)]))
    ref = ReferenceVM(prog, g.weights)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert rel_err(outs[2][-1], torch.stack([ref.step(3 + i, i).clone() for i in range(3)])[-1]) <= 2e-3


def test_wait_prefetch_knobs_leave_results_bit_identical():
    """wait_prefetch_kb / wait_prefetch_next_kb / wait_prefetch_pace_kb only ask L2 for weight bytes while a task
    waits (its own, then the next queued task's, all at once or a few KB per poll): the logits must not change by a
    bit, and match the ReferenceVM."""
    from vm.loader import MegakernelVM, launch_knobs
    g = graph("wide", "bf16")
    outs = []
    knobs = [{}, {"wait_prefetch_kb": 0}, {"wait_prefetch_next_kb": 512},
             {"wait_prefetch_kb": 256, "wait_prefetch_next_kb": 128, "wait_prefetch_pace_kb": 4},
             {"wait_prefetch_next_kb": 64, "wait_prefetch_pace_kb": 32}]
    for kn in knobs:
        prog = lower(g, TARGETS["h100"], {**CONFIGS["default"], **kn}, max_seq=48)
        vm = MegakernelVM(prog, g.weights)
        assert vm.wait_prefetch_next_bytes == launch_knobs(prog.config)["wait_prefetch_next_bytes"]
        assert vm.wait_prefetch_pace_bytes == 1024 * kn.get("wait_prefetch_pace_kb", 0)
        outs.append(torch.stack([vm.step(3 + i, 2 * i).clone() for i in range(3)]))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(outs[-1], torch.stack([ref.step(3 + i, 2 * i).clone() for i in range(3)])) <= 2e-2


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_qk_norm_rope_tasks_match_whole_head_qkv_tiles(dtype):
    """QK-norm model (head_dim 128): split QKV tiles writing RAW rows + QK_NORM_ROPE tasks give the same logits as
    whole-head QKV tiles with the QK-norm inside (qkv_head_split 1), bit for bit: each projected row is the same dot
    product on both paths and the norm + RoPE epilogue is one function (amk_head_norm_rope). Also against the
    reference VM, over several positions (the K rows written at earlier positions are read back)."""
    from vm.loader import MegakernelVM
    g = graph("hd128", dtype)
    outs = []
    for hs in (1, 2, 4):
        prog = lower(g, TARGETS["h100"], {**CONFIGS["default"], "qkv_head_split": hs, "fold_qk_norm": False},
                     max_seq=48)
        assert (hs > 1) == any(t.op == "QK_NORM_ROPE" for t in prog.tasks)
        vm = MegakernelVM(prog, g.weights)
        outs.append(torch.stack([vm.step(5 + 7 * i, i).clone() for i in range(4)]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = ReferenceVM(prog, g.weights)
    want = torch.stack([ref.step(5 + 7 * i, i).clone() for i in range(4)])
    assert rel_err(outs[2], want) <= (2e-3 if dtype == "bf16" else 1e-4)


@pytest.mark.parametrize("name,dtype,splits,extra", [("hd128", "bf16", 3, {}), ("hd128", "bf16", 1, {}),
                                                     ("hd128", "bf16", 2, {"early_kv": "on"}),
                                                     ("hd128", "f32", 3, {}), ("qwen3", "bf16", 2, {})])
def test_folded_qk_norm_is_bit_identical_to_qk_norm_tasks(name, dtype, splits, extra):
    """fold_qk_norm: the attention tasks finishing the RAW q rows themselves (and the last split / ATTN_DECODE the
    new K row, read back at later positions) give the same logits as QK_NORM_ROPE tasks, bit for bit (one epilogue,
    amk_head_norm_rope), on the tensor-core body (bf16, head_dim 128), with its KV history issued before the wait,
    and on the generic one (fp32; head_dim 16); and match the ReferenceVM."""
    g = graph(name, dtype)
    outs = []
    for fold in (False, True):
        def check(prog):
            assert any(t.op == "QK_NORM_ROPE" for t in prog.tasks) != fold
            assert any(t.params.get("append_k") for t in prog.tasks) == fold
        outs.append(_four_steps(g, {"qkv_head_split": 2, "attn_splits": splits, "fold_qk_norm": fold, **extra}, check))
    assert torch.isfinite(outs[1][0]).all()
    assert torch.equal(outs[0][0], outs[1][0])
    assert rel_err(outs[1][0], outs[1][1]) <= (1e-4 if dtype == "f32" else 2e-2)


def _four_steps(g, cfg: dict, check):
    """(GPU logits, ReferenceVM logits) of steps (3 + i, position 5i), i < 4, under the default config + cfg;
    check(program) runs first."""
    from vm.loader import MegakernelVM
    prog = lower(g, TARGETS["h100"], {**CONFIGS["default"], **cfg}, max_seq=48)
    check(prog)
    run = lambda vm: torch.stack([vm.step(3 + i, 5 * i).clone() for i in range(4)])  # noqa: E731
    return run(MegakernelVM(prog, g.weights)), run(ReferenceVM(prog, g.weights))


@pytest.mark.parametrize("name,dtype,splits", [("llama-untied", "f32", 3), ("wide", "bf16", 8),
                                               ("hd128", "bf16", 5), ("merge-odd", "f32", 3)])
def test_attn_merge_in_o_proj_is_bit_identical_to_merge_tasks(name, dtype, splits):
    """fuse_attn_merge: o_proj merging the split-KV partials while it stages x gives the same bits as ATTN_MERGE
    tasks (one definition of the merge arithmetic), and matches the ReferenceVM."""
    g = graph(name, dtype)
    outs = []
    for fuse in (True, False):
        def check(prog):
            assert any(t.op == "ATTN_MERGE" for t in prog.tasks) != fuse
            assert any(t.params.get("x_splits", 0) == splits for t in prog.tasks) == fuse
        outs.append(_four_steps(g, {"attn_splits": splits, "fuse_attn_merge": fuse}, check))
    assert torch.isfinite(outs[0][0]).all()
    assert torch.equal(outs[0][0], outs[1][0])
    assert rel_err(outs[0][0], outs[0][1]) <= (1e-5 if dtype == "f32" else 2e-2)


@pytest.mark.parametrize("name,dtype,splits", [("llama-untied", "f32", 3), ("llama-untied", "bf16", 1),
                                               ("wide", "bf16", 4), ("hd128", "bf16", 2), ("merge-odd", "f32", 3),
                                               ("odd", "f32", 2), ("qwen2", "bf16", 4)])
def test_o_proj_by_group_matches_reference(name, dtype, splits):
    """o_proj_by_group: per-KV-group o_proj tiles (short rows of group*head_dim columns, the scalar path for odd
    sizes) add atomically into the residual stream; the logits match the ReferenceVM over several positions and
    the program without the knob, to fp32 reordering (f32) or bf16 tolerance."""
    g = graph(name, dtype)
    outs = []
    for by_group in (True, False):
        def check(prog):
            assert any(t.params.get("accumulate") for t in prog.tasks) == by_group
        outs.append(_four_steps(g, {"attn_splits": splits, "o_proj_by_group": by_group}, check))
    (got, want), (plain, _) = outs
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == "f32" else 2e-2
    assert rel_err(got, want) <= tol
    assert rel_err(got, plain) <= tol


@pytest.mark.parametrize("name,dtype,cfg", [
    ("llama-untied", "f32", {}), ("llama-untied", "bf16", {"balance_tiles": True}),   # 22-row tiles: scalar down
    ("wide", "bf16", {"mlp_rows": 64}),     # down rows of 8 chunks, 4 rows per warp load (llama-3.2-1b's shape)
    ("wide", "bf16", {"num_sms": 2}),       # 1024-row tiles: long down rows, the generic tile loop
    ("hd256", "bf16", {"num_sms": 2}),      # 48-row tiles: 6 chunks per down row (8 lanes, 2 of them idle)
    ("qwen3", "bf16", {}), ("odd", "f32", {})])
def test_fused_mlp_tiles_match_reference(name, dtype, cfg):
    """fuse_down: every MLP tile adds its share of down_proj into the next layer's residual stream (seeded by
    o_proj's copy); the logits match the ReferenceVM and the program without the knob, to fp32 reordering (f32)
    or bf16 tolerance, over several positions."""
    g = graph(name, dtype)
    outs = []
    for fused in (True, False):
        def check(prog):
            assert any(t.op == "GEMV_SILU_MUL_DOWN" for t in prog.tasks) == fused
            assert any(t.params.get("has_copy") for t in prog.tasks) == fused
        outs.append(_four_steps(g, {**cfg, "fuse_down": fused}, check))
    (got, want), (plain, _) = outs
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == "f32" else 2e-2
    assert rel_err(got, want) <= tol
    assert rel_err(got, plain) <= tol


def _ref_greedy(prog, g, first, start, n):
    ref = ReferenceVM(prog, g.weights)
    for p in range(start):  # same prefix as the GPU VM saw
        ref.step(first, p)
    out, tok = [], first
    for i in range(n):
        tok = int(torch.argmax(ref.step(tok, start + i)))
        out.append(tok)
    return out


@pytest.mark.parametrize("use_graph", [True, False])
def test_decode_has_no_host_sync_per_token(use_graph):
    g, prog, vm = make("qwen3", "f32", "default", max_seq=64)
    n = 12
    if use_graph:
        vm.prepare_decode(n)              # capture outside the sync-checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = vm.decode_device(n, first_token=5, start_pos=0, use_graph=use_graph)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    vm.check_status()
    assert out.tolist() == _ref_greedy(prog, g, 5, 0, n)
    assert int(vm.pos.item()) == n


def test_decode_chunks_match_reference_and_generate():
    g, prog, vm = make("llama-tied-rope3", "f32", "split", max_seq=64)
    toks = vm.decode(9, 0, 20, chunk=8)   # 8 + 8 (graph replays) + 4 (eager)
    assert toks == _ref_greedy(prog, g, 9, 0, 20)
    vm.reset()
    gen = vm.generate([9, 9, 9], 5, chunk=4)
    ref = ReferenceVM(prog, g.weights)
    for i in range(2):
        ref.step(9, i)
    logits = ref.step(9, 2)
    want = []
    for i in range(5):
        want.append(int(torch.argmax(logits)))
        logits = ref.step(want[-1], 3 + i)
    assert gen == want


def test_knobs_change_the_build():
    from vm import jit
    g, prog, vm = make("llama-untied", "f32", "default")
    assert jit.spec_for(256, 0).name() != jit.spec_for(512, 2).name() != jit.spec_for(512, 3).name()
    info = vm.ext.build_info()
    assert (info["threads"], info["prefetch_depth"]) == (vm.threads, vm.prefetch_depth)
    if vm.prefetch_depth > 0:
        assert vm.prefetch_cap > 0 and int(vm.instrs_np["prefetch_bytes"].max()) > 0


@pytest.mark.parametrize("split", [True, False, "pairs"])
def test_argmax_ties_across_lm_head_tiles(split):
    """next_token on the GPU is torch.argmax of its logits (first index on ties) with and without split_argmax (and
    with the tiles' own pairs, argmax_in_lm_head), on
    an LM head whose rows [r1, vocab) are one row w (equal logits, tied across tiles) and rows [0, r1) are w / 2:
    the answer is r1 (w . x > 0) or 0, and each sign of w gives one of them."""
    from vm.loader import MegakernelVM
    g = graph("llama-untied", "f32", seed=8)
    key = "lm_head.weight"
    V, r1 = g.config.vocab, 77                    # lm_head_rows 16: r1 inside the 5th tile, ties span the rest
    w = torch.randn(g.config.hidden, generator=torch.Generator().manual_seed(2))
    out = {}
    for sign in (1.0, -1.0):
        lm = (sign * w).repeat(V, 1)
        lm[:r1] *= 0.5
        weights = {**g.weights, key: lm.to(g.weights[key].dtype)}
        cfg = {"lm_head_rows": 16, "num_sms": 8, "split_argmax": bool(split), "argmax_in_lm_head": split == "pairs"}
        prog = lower(g, TARGETS["h100"], cfg, max_seq=16)
        assert sum(t.op == "ARGMAX_PARTIAL" for t in prog.tasks) == (-(-V // 16) if split is True else 0)
        assert sum(t.op == "ARGMAX_PAIRS" for t in prog.tasks) == (split == "pairs")
        vm = MegakernelVM(prog, weights)
        logits = vm.step(9, 0).cpu()
        tok = int(vm.next_token.item())
        assert tok == int(torch.argmax(logits)) == (r1 if float(logits[r1]) > 0 else 0)
        out[sign] = (tok, logits)
    assert {t for t, _ in out.values()} == {0, r1}   # one sign puts the tie on top, the other the halved rows


@pytest.mark.parametrize("name,dtype", [("llama-untied", "f32"), ("qwen3", "bf16")])
def test_argmax_in_lm_head_matches_the_split_argmax(name, dtype):
    """argmax_in_lm_head: the same logits bit for bit and the same next token as the split argmax, over steps,
    and both match the ReferenceVM."""
    from vm.loader import MegakernelVM
    g = graph(name, dtype)
    cfg = {"lm_head_rows": 16, "num_sms": 8}
    vms = [MegakernelVM(lower(g, TARGETS["h100"], {**cfg, "argmax_in_lm_head": v}, max_seq=16), g.weights)
           for v in (False, True)]
    ref = ReferenceVM(vms[1].program, g.weights)
    for tok, pos in [(3, 0), (41, 1), (7, 2)]:
        a, b = (vm.step(tok, pos).clone() for vm in vms)
        assert torch.equal(a, b)
        assert int(vms[0].next_token.item()) == int(vms[1].next_token.item()) == int(torch.argmax(b))
        want = ref.step(tok, pos)
        assert rel_err(b, want) <= (1e-5 if dtype == "f32" else 2e-2)
        if dtype == "f32":
            assert int(ref.io("next_token")[0]) == int(vms[1].next_token.item())


@pytest.mark.parametrize("name,dtype,cfg", [
    ("llama-untied", "f32", {"dyn_mlp_rows": 32}),            # 176 rows: 6 chunks on 8 SMs, the last one half
    ("llama-untied", "f32", {"dyn_mlp_rows": 4}),             # 44 chunks on 8 members: tickets do most of the work
    ("wide", "bf16", {"dyn_mlp_rows": 8, "num_sms": 16}),     # llama-3.2-1b's chunk (8 rows x 2 x 1024 bf16)
    ("qwen3", "bf16", {"dyn_mlp_rows": 16, "num_sms": 3}),
    ("odd", "f32", {"dyn_mlp_rows": 8}),                      # K = 90: the scalar path inside every chunk
    ("llama-untied", "f32", {"dyn_mlp_rows": 4, "dyn_mlp_static": 75}),   # own 16-row tiles, then 4-row tickets
    ("wide", "bf16", {"dyn_mlp_rows": 8, "dyn_mlp_static": 90, "num_sms": 16}),
    # one-row tickets drawn per warp: own tiles of 32 rows (+16 by ticket) / 112 rows (+256 by ticket)
    ("llama-untied", "f32", {"dyn_mlp_rows": 1, "dyn_mlp_static": 100, "num_sms": 5}),
    ("wide", "bf16", {"dyn_mlp_rows": 1, "dyn_mlp_static": 90, "num_sms": 16}),
    ("odd", "f32", {"dyn_mlp_rows": 1, "dyn_mlp_static": 75, "num_sms": 2})])
def test_claim_groups_match_reference_and_rerun_bit_identical(name, dtype, cfg):
    """dyn_mlp_rows: gate/up as claim groups whose members split the rows at run time (atomic tickets). The
    logits match the ReferenceVM (any partition computes the same rows) and the static tiles' program, consecutive
    launches reset the claim counters themselves (four steps without a host reset), and a rerun from the same
    state gives the same bits however the chunks fell."""
    from vm.loader import MegakernelVM
    g = graph(name, dtype)

    def check(prog):
        assert any(t.params.get("dyn_rows") for t in prog.tasks if t.op == "GEMV_SILU_MUL")
    got, want = _four_steps(g, cfg, check)
    plain, _ = _four_steps(g, {k: v for k, v in cfg.items() if not k.startswith("dyn_")}, lambda p: None)
    tol = 1e-5 if dtype == "f32" else 2e-2
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= tol
    assert rel_err(got, plain) <= tol
    prog = lower(g, TARGETS["h100"], {**CONFIGS["default"], **cfg}, max_seq=48)
    vm = MegakernelVM(prog, g.weights)
    a = vm.step(3, 0).clone()
    vm.reset()
    b = vm.step(3, 0).clone()
    assert torch.equal(a, b), "a claim group's result must not depend on which member took which chunk"
    assert int(vm.counters.abs().sum()) == 0, "the launch's last block must reset the claim counters too"
