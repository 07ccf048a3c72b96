"""flag_hops on the GPU: data-flagged activations give the same bits as the counter protocol, launch after launch,
and a flagged input that never arrives times out into a named error (no hang), after which the VM runs again.

The values flow through the same arithmetic in the same order (the flagged layout only adds a tag word to each
element), so the logits must be bit-identical to the default program's, and within the usual tolerance of the CPU
ReferenceVM (fp32: 1e-5 of max|ref|; bf16: 2e-2).
"""
from __future__ import annotations

import copy
import time

import pytest
import torch

from schedule.ir import TARGETS
from schedule.lower import lower
from tests.vm.test_megakernel_gpu import graph, rel_err
from vm.reference_vm import ReferenceVM

pytestmark = pytest.mark.cuda

CFG = {"num_sms": 16}


def _pair(name: str, dtype: str, cfg: dict, max_seq: int = 64):
    from vm.loader import MegakernelVM
    g = graph(name, dtype)
    base = lower(g, TARGETS["h100"], cfg, max_seq=max_seq)
    flag = lower(g, TARGETS["h100"], {**cfg, "flag_hops": "all"}, max_seq=max_seq)
    assert any(b.flagged for b in flag.buffers) and any(w.data for t in flag.tasks for w in t.waits)
    return g, base, flag, MegakernelVM(base, g.weights), MegakernelVM(flag, g.weights)


@pytest.mark.parametrize("name,dtype,cfg", [
    ("llama-untied", "f32", CFG),
    ("llama-untied", "bf16", CFG),
    ("qwen3", "bf16", {"num_sms": 24, "attn_splits": 3}),
    ("odd", "f32", {"num_sms": 8}),   # K % 4 != 0: the scalar poll path
    ("llama-untied", "bf16", {**CFG, "dyn_mlp_rows": 1}),   # claim groups write the flagged h
])
def test_flagged_program_is_bit_identical(name, dtype, cfg):
    g, base, flag, vb, vf = _pair(name, dtype, cfg)
    ref = ReferenceVM(flag, g.weights)
    tol = 1e-5 if dtype == "f32" else 2e-2
    for tok, pos in [(3, 0), (17, 1), (5, 2), (5, 2), (40, 7)]:   # the same step twice: a new launch, a new tag
        want = vb.step(tok, pos).clone()
        got = vf.step(tok, pos).clone()
        assert torch.equal(got, want), f"pos {pos}: flagged logits differ from the counter program's"
        assert rel_err(got, ref.step(tok, pos)) <= tol
    x = vf.read_activation("x2" if g.config.n_layers >= 2 else "x1")
    assert torch.isfinite(x).all() and x.abs().max() > 0


def test_flagged_decode_loop_matches():
    """Greedy decode on the device (one launch per token, the epoch advancing in the kernel; CUDA-graph replay for
    whole chunks, and the eager path for a partial one): the same tokens as the counter program."""
    g, base, flag, vb, vf = _pair("llama-untied", "bf16", CFG)
    assert vf.decode(3, 0, 12, chunk=8) == vb.decode(3, 0, 12, chunk=8)
    assert vf.decode(7, 20, 5, use_graph=False) == vb.decode(7, 20, 5, use_graph=False)


def test_flagged_input_never_written_times_out_then_runs():
    """A producer of a flagged buffer that writes nothing (an ATTN_MERGE patched to 0 heads) leaves its words
    untagged: the launch stops with a timeout within the budget (the first block out of time reports it: an o_proj
    task's poll of the flagged input, or a task spinning on a counter behind it; H100: either has come first), no
    hang, and after the task is restored the next launches are correct (the flagged buffers were cleared with the
    epoch, so no word of the failed launch passes for a later one's)."""
    from vm.loader import MegakernelVM
    g = graph("llama-untied", "f32")
    flag = lower(g, TARGETS["h100"], {**CFG, "flag_hops": "all"}, max_seq=64)
    ref = ReferenceVM(flag, g.weights)
    k = next(i for i, t in enumerate(flag.tasks) if t.op == "ATTN_MERGE")
    assert flag.buffers[flag.tasks[k].outputs[0]].flagged
    vm = MegakernelVM(flag, g.weights, timeout_s=0.5)
    good = vm.instrs_np[k]["ip"].copy()
    bad = good.copy()
    from vm.abi import OPCODES
    bad[OPCODES["ATTN_MERGE"].iparams.index("group")] = 0
    vm.patch_instr(k, ip=bad)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"timeout") as ei:
        vm.step(5, 0)
    assert "polled a data-flagged input" in str(ei.value) or "waited on counter" in str(ei.value), str(ei.value)
    assert time.perf_counter() - t0 < 4.0
    vm.patch_instr(k, ip=good)
    assert rel_err(vm.step(5, 0), ref.step(5, 0)) <= 1e-5
    assert rel_err(vm.step(9, 1), ref.step(9, 1)) <= 1e-5
