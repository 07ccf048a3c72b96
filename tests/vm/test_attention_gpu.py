"""GPU decode attention over a long, random KV cache against the CPU ReferenceVM (fp32 math, same cache).

The other GPU tests fill the cache a few positions at a time, so most rows they attend are zero. Here both VMs get
the same random K / V rows in every position; one step at position P then writes row P and attends [lo, P]. That
exercises many tiles per task, short last tiles, split-KV partials and the merge, sliding windows, GQA groups of
1..9 heads and head dims 64 / 128: the shapes of the tensor-core path (vm/csrc/ops_attention_mma.cuh: 2-byte
caches, head_dim 64 or 128, G <= 8) and of the generic fp32-FMA path (fp32 caches, G > 8, other head dims).

Checked per step: layer 0's attention output (the op under test: its inputs q and the cache are the same up to
fp32 summation order) and the logits, both as max|gpu - ref| / max|ref|. The tensor-core path rounds q and the
softmax weights to the cache type before the MMA (as a bf16 SDPA does), hence the 2-byte tolerances.
"""
from __future__ import annotations

import pytest
import torch

from schedule.graph import ModelConfig, ModelGraph, random_weights
from schedule.ir import TARGETS, BufferKind
from schedule.lower import lower
from tests.vm.test_megakernel_gpu import rel_err
from vm.reference_vm import ReferenceVM

pytestmark = pytest.mark.cuda

S = 1100   # KV-cache length: at head_dim 64, 8 full 128-key tiles plus a short one
SHAPES = {  # name: (arch, heads, kv heads, head_dim, window)
    "g4-hd64": ("llama", 8, 2, 64, None),
    "g8-hd64-window": ("mistral", 8, 1, 64, 300),
    "g1-hd64": ("llama", 2, 2, 64, None),
    "g3-hd128": ("llama", 6, 2, 128, None),
    "g9-hd64": ("llama", 9, 1, 64, None),     # G > 8: the generic path
    "g2-hd96": ("llama", 4, 2, 96, None),     # head_dim 96: the generic path
}
# (attention output, logits) tolerances per cache dtype
TOL = {"bf16": (2e-2, 2e-2), "f16": (4e-3, 4e-3), "f32": (1e-5, 1e-5)}


def _graph(name: str, dtype: str) -> ModelGraph:
    arch, nh, nkv, hd, win = SHAPES[name]
    c = ModelConfig(arch, 211, 128, 160, 2, nh, nkv, hd, 1e-5, 10000.0, None, False, sliding_window=win,
                    max_position=S)
    return ModelGraph(name, c, random_weights(c, dtype, 5), dtype)


def _fill_caches(prog, gpu_vm, ref_vm, seed: int) -> None:
    """The same random rows in every KV-cache buffer of both VMs (K ~ N(0, 1), V ~ N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    for b in prog.buffers:
        if b.kind == BufferKind.KV_CACHE:
            data = torch.randn(tuple(b.shape), generator=gen).to(ref_vm.buf(b.id).dtype)
            ref_vm.buf(b.id).copy_(data)
            gpu_vm.tensors[b.id].copy_(data.to(gpu_vm.tensors[b.id].device))


def _check(name: str, dtype: str, splits: int, steps: list[tuple[int, int]], seed: int) -> None:
    """Fill both VMs' caches with the same random rows, then compare layer 0's attention output and the logits."""
    from vm.loader import MegakernelVM
    g = _graph(name, dtype)
    prog = lower(g, TARGETS["h100"], {"num_sms": 16, "attn_splits": splits}, max_seq=S)
    vm = MegakernelVM(prog, g.weights)
    ref = ReferenceVM(prog, g.weights, seed=1)
    _fill_caches(prog, vm, ref, seed=seed)
    attn0 = prog.buffer("attn0").id
    tol_attn, tol_logits = TOL[dtype]
    for tok, pos in steps:
        want = ref.step(tok, pos)
        got = vm.step(tok, pos).clone()
        assert torch.isfinite(got).all(), f"pos {pos}: non-finite logits"
        ea = rel_err(vm.tensors[attn0], ref.buf(attn0))
        el = rel_err(got, want)
        assert ea <= tol_attn, f"pos {pos}: attention output rel err {ea:.3g} > {tol_attn}"
        assert el <= tol_logits, f"pos {pos}: logits rel err {el:.3g} > {tol_logits}"


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("splits", [0, 3])
def test_long_random_cache_matches_reference(name, dtype, splits):
    _check(name, dtype, splits, [(3, S - 1), (40, 517), (7, 130), (9, 5)], seed=11)


def test_fp32_cache_takes_the_exact_path():
    """fp32 caches never round q or p: the same long random cache matches the reference to fp32 precision."""
    _check("g4-hd64", "f32", 3, [(3, S - 1), (40, 517)], seed=12)


def _same_bits(g, prog, plain, vm_h, vm_p, seed: int, steps) -> None:
    """vm_h (prog, hinted) and vm_p (plain) on the same random caches: bit-identical layer-0 attention outputs and
    logits at every (token, pos) step, and both within the bf16 tolerances of the reference VM."""
    ref = ReferenceVM(prog, g.weights, seed=1)
    _fill_caches(prog, vm_h, ref, seed=seed)
    _fill_caches(plain, vm_p, ref, seed=seed)
    attn0 = prog.buffer("attn0").id
    tol_attn, tol_logits = TOL["bf16"]
    for tok, pos in steps:
        want = ref.step(tok, pos)
        got_h, got_p = vm_h.step(tok, pos).clone(), vm_p.step(tok, pos).clone()
        assert torch.equal(vm_h.tensors[attn0], vm_p.tensors[attn0]), f"pos {pos}: attention output differs"
        assert torch.equal(got_h, got_p), f"pos {pos}: logits differ"
        assert rel_err(vm_h.tensors[attn0], ref.buf(attn0)) <= tol_attn, f"pos {pos}: attention vs reference"
        assert rel_err(got_h, want) <= tol_logits, f"pos {pos}: logits vs reference"


@pytest.mark.parametrize("name", ["g4-hd64", "g8-hd64-window", "g3-hd128"])
def test_early_kv_hint_gives_the_same_bits(name):
    """Attention tasks with the early_kv hint (their KV history rows copied before the wait: amk_attn_early in
    vm/csrc/ops_attention_mma.cuh, compiled in because the program has hints) give bit-identical attention outputs
    and logits to the same program without hints (built without the path), and match the reference: positions in
    the first tile, in later tiles and at the end of the cache, with 3 splits (pos in the last one)."""
    from schedule.ir import MegakernelProgram, validate
    from vm.loader import MegakernelVM
    g = _graph(name, "bf16")
    plain = lower(g, TARGETS["h100"], {"num_sms": 16, "sm_assignment": "list", "attn_splits": 3, "early_kv": "off"},
                  max_seq=S)
    prog = MegakernelProgram.from_json(plain.to_json())
    for t in prog.tasks:   # hints set by hand (the lowering sets them only where the SM idles long enough)
        if t.op in ("ATTN_PARTIAL", "ATTN_DECODE"):
            t.params["early_kv"] = 1
    assert not any(t.params.get("early_kv") for t in plain.tasks) and validate(prog).ok
    vm_h, vm_p = MegakernelVM(prog, g.weights), MegakernelVM(plain, g.weights)
    assert vm_h.spec.attn_early and not vm_p.spec.attn_early
    _same_bits(g, prog, plain, vm_h, vm_p, 13, [(3, S - 1), (40, 517), (7, 130), (9, 5), (2, 0)])


@pytest.mark.parametrize("name", ["g4-hd64", "g8-hd64-window", "g3-hd128", "g9-hd64"])
@pytest.mark.parametrize("splits", [3, 8])
def test_kv_ahead_gives_the_same_bits(name, splits):
    """early_kv 'ahead' (each attention task's KV history issued by the task before it in its queue, into the stage
    region at the top of shared memory: amk_kv_ahead, an AMK_KV_AHEAD build) gives bit-identical attention outputs
    and logits to the same placement without hints, and matches the reference: positions in the first tile, later
    tiles, the last split and the end of the cache; 8 splits put several attention tasks behind QKV tasks of other
    groups. g9-hd64 (G > 8) takes the generic path, which must ignore the hint."""
    from schedule.ir import validate
    from vm.loader import MegakernelVM
    g = _graph(name, "bf16")
    cfg = {"num_sms": 16, "sm_assignment": "list", "attn_splits": splits}
    plain = lower(g, TARGETS["h100"], {**cfg, "early_kv": "off"}, max_seq=S)
    prog = lower(g, TARGETS["h100"], {**cfg, "early_kv": "ahead"}, max_seq=S)
    assert [t.sm for t in prog.tasks] == [t.sm for t in plain.tasks] and validate(prog).ok
    n_ahead = sum(int(t.params.get("early_kv", 0)) == 2 for t in prog.tasks)
    assert n_ahead > 0 and not any(t.params.get("early_kv") for t in plain.tasks)
    vm_h, vm_p = MegakernelVM(prog, g.weights), MegakernelVM(plain, g.weights)
    assert vm_h.spec.kv_ahead and not vm_p.spec.kv_ahead
    assert vm_h.smem_bytes >= vm_p.smem_bytes    # (the stage region sits above every op area)
    _same_bits(g, prog, plain, vm_h, vm_p, 17, [(3, S - 1), (40, 517), (7, 130), (9, 5), (2, 0), (5, 777)])
