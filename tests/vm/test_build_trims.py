"""The kernel build holds only the code a program's tasks can reach (vm/pack.py build_trims -> vm/jit.py BuildSpec
ops / attn_hds / qk_fold / group_early -> -DAMK_OPS_MASK, -DAMK_ATTN_HD64/128, -DAMK_QK_FOLD, -DAMK_GROUP_EARLY):
which opcodes and paths each preset's program keeps (hand-listed), the flags and digests of the spec, the trimmed
translation unit compiling without the left-out functions (nvcc, ptxas -v), and on a GPU a task whose opcode was
left out failing with a named error, after which the next launch computes the reference again."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import time

import pytest

from schedule.graph import load_model
from schedule.ir import get_target
from schedule.lower import lower
from vm import abi, jit
from vm.pack import build_trims

CSRC = pathlib.Path(__file__).resolve().parents[2] / "vm" / "csrc"
LLAMA_OPS = {"EMBED", "QKV_ROPE", "ATTN_PARTIAL", "ATTN_MERGE", "GEMV", "GEMV_SILU_MUL", "L2_PREFETCH", "ARGMAX_PAIRS"}


def _ops(mask: int) -> set[str]:
    return {op.name for op in abi.OPCODES.values() if mask >> op.code & 1}


@pytest.mark.parametrize("model,cfg,ops,hds,fold,group", [
    ("llama-3.2-1b", {}, LLAMA_OPS, 1, False, False),
    # fuse_down: the MLP tiles are GEMV_SILU_MUL_DOWN and add the down projection themselves (o_proj stays a GEMV)
    ("llama-3.2-1b", {"fuse_down": True}, LLAMA_OPS - {"GEMV_SILU_MUL"} | {"GEMV_SILU_MUL_DOWN"}, 1, False, False),
    ("llama-3.2-1b", {"o_proj_by_group": True}, LLAMA_OPS - {"ATTN_MERGE"}, 1, False, True),
    ("llama-3.2-1b", {"attn_splits": 1}, LLAMA_OPS - {"ATTN_PARTIAL", "ATTN_MERGE"} | {"ATTN_DECODE"}, 1, False,
     False),
    ("llama-3.2-1b", {"split_argmax": False}, LLAMA_OPS - {"ARGMAX_PAIRS"} | {"ARGMAX"}, 1, False, False),
    ("qwen3-0.6b", {}, LLAMA_OPS, 2, True, False),   # head_dim 128, QK-norm folded into attention
    ("qwen3-0.6b", {"fold_qk_norm": False}, LLAMA_OPS | {"QK_NORM_ROPE"}, 2, False, False),
])
def test_trims_follow_the_program(model, cfg, ops, hds, fold, group):
    prog = lower(load_model(model, dtype="bf16", device="meta"), get_target("h100"), cfg, max_seq=576)
    t = build_trims(prog)
    assert _ops(t["ops"]) == ops
    assert (t["attn_hds"], t["qk_fold"], t["group_early"]) == (hds, fold, group)


def test_spec_flags_and_digests():
    full = jit.spec_for(arch="sm_90a")
    assert not any("OPS_MASK" in f or "QK_FOLD" in f for f in full.cuda_cflags())   # the untrimmed build unchanged
    mask = sum(1 << abi.OPCODES[n].code for n in LLAMA_OPS)
    trim = jit.spec_for(arch="sm_90a", ops=mask, attn_hds=1, qk_fold=False, group_early=False)
    flags = trim.cuda_cflags()
    assert f"-DAMK_OPS_MASK={mask:#x}u" in flags
    assert {"-DAMK_ATTN_HD64=1", "-DAMK_ATTN_HD128=0", "-DAMK_QK_FOLD=0", "-DAMK_GROUP_EARLY=0"} <= set(flags)
    assert trim.digest() != full.digest()
    assert jit.spec_for(arch="sm_90a", ops=mask).digest() != jit.spec_for(arch="sm_90a", ops=mask | 4).digest()
    with pytest.raises(jit.BuildError, match="ops mask"):
        jit.BuildSpec(arch="sm_90a", tma=False, ops=1 << 31)
    with pytest.raises(jit.BuildError, match="head-dim mask"):
        jit.BuildSpec(arch="sm_90a", tma=False, attn_hds=4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_trimmed_build_leaves_the_other_code_out(tmp_path):
    """llama-3.2-1b's trims for sm_90a: the ops it never runs, the head-dim-128 attention body, the folded QK-norm
    and the by-group o_proj body are not in the object; what it runs is."""
    prog = lower(load_model("llama-3.2-1b", dtype="bf16", device="meta"), get_target("h100"), {}, max_seq=576)
    spec = jit.spec_for(512, 2, "sm_90a", False, dtypes=jit.dtype_mask(["bf16"]), merge_unroll=4,
                        **build_trims(prog))
    defs = [f for f in spec.cuda_cflags() if f.startswith("-D")]
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", "-cubin", str(CSRC / "megakernel.cu"), "-o",
                        str(tmp_path / "mk.cubin"), f"-I{CSRC}", "-gencode=arch=compute_90a,code=sm_90a",
                        "-Xptxas=-v", *defs], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    # ptxas -v reports every function it compiled, the noinline device functions included
    names = " ".join(re.findall(r"Function properties for (\S+)", r.stderr))
    assert "amk_megakernel" in names, names[:500]   # the listing itself worked
    for gone in ("amk_op_rmsnorm", "amk_op_add", "amk_op_argmaxR", "amk_silu_down_body", "amk_op_qk_norm_rope",
                 "amk_gemv_group_body", "amk_attn_fold_qk", "Li128E"):
        assert gone not in names, gone
    for kept in ("amk_op_embed", "amk_op_qkv_rope", "amk_gemv_body", "amk_silu_body", "amk_op_attn_merge",
                 "amk_op_argmax_pairs", "amk_op_l2_prefetch", "Li64E"):
        assert kept in names, kept


@pytest.mark.cuda
def test_left_out_opcode_traps_by_name_then_valid_launch():
    """An opcode the ABI knows but this build left out stops the launch with an error that says so; restored, the
    next launch matches the reference VM."""
    import torch
    from schedule.ir import TARGETS
    from tests.vm.test_megakernel_gpu import graph, rel_err
    from vm.loader import MegakernelVM
    from vm.reference_vm import ReferenceVM
    g = graph("llama-untied", "f32")
    prog = lower(g, TARGETS["h100"], {}, max_seq=48)
    vm = MegakernelVM(prog, g.weights)
    ref = ReferenceVM(prog, g.weights)
    absent = next(op for op in abi.OPCODES.values() if not vm.spec.ops >> op.code & 1)
    k = next(i for i, t in enumerate(prog.tasks) if t.op == "GEMV_SILU_MUL")
    good = int(vm.instrs_np[k]["op"])
    vm.patch_instr(k, op=absent.code)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"opcode {absent.code} \({absent.name}\).*not compiled into this build"):
        vm.step(5, 0)
    assert time.perf_counter() - t0 < 5.0
    vm.patch_instr(k, op=good)
    out = vm.step(5, 0)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.step(5, 0)) <= 1e-5


def test_build_clears_a_stale_torch_baton(tmp_path, monkeypatch):
    """A build killed mid-way (a test timeout on the GPU machine, forty-eighth session) leaves torch's baton file
    `lock` in the build directory, on which torch's next build of that name waits forever: jit.build removes it
    under its own lock before it calls torch's load (faked here: no compiler runs)."""
    import torch.utils.cpp_extension as cpp
    monkeypatch.setenv("AMK_CACHE_DIR", str(tmp_path))
    spec = jit.spec_for(arch="sm_90a", tma=False)
    bdir = tmp_path / spec.name()
    bdir.mkdir()
    (bdir / "lock").write_text("")
    seen = {}

    def fake_load(name, build_directory, **kw):
        seen["baton"] = (pathlib.Path(build_directory) / "lock").exists()
        raise RuntimeError("no compiler in this test")
    monkeypatch.setattr(cpp, "load", fake_load)
    with pytest.raises(jit.BuildError, match="no compiler in this test"):
        jit.build(spec)
    assert seen == {"baton": False}
