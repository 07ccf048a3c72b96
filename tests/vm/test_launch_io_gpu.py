"""A decode step is ONE launch: the kernel's last block resets the counters and does the step's IO bookkeeping
(amk_exit in vm/csrc/megakernel.cu; int token / position travel in the launch params; greedy decode feeds
next_token back itself). Checked against the CPU ReferenceVM over launches that are never separated by a host
reset, and on the error path (an aborted launch keeps its counters for the report, the host then clears them).
"""
from __future__ import annotations

import pytest
import torch

from tests.vm.test_megakernel_gpu import make, rel_err
from vm.reference_vm import ReferenceVM

pytestmark = pytest.mark.cuda

STEPS = [(5, 0), (17, 1), (3, 2), (29, 3), (11, 4), (2, 5)]


@pytest.mark.parametrize("name,cfg", [("llama-untied", "default"), ("qwen3", "split")])
def test_back_to_back_launches_reset_their_own_counters(name, cfg):
    g, prog, vm = make(name, "f32", cfg, max_seq=32)
    ref = ReferenceVM(prog, g.weights)
    outs = []
    for tok, pos in STEPS:   # no host sync, no memset between the launches
        outs.append(vm.step(tok, pos, check=False).clone())
    vm.check_status()
    for (tok, pos), got in zip(STEPS, outs):
        assert rel_err(got, ref.step(tok, pos)) <= 1e-5, f"step at pos {pos}"
    assert int(vm.counters.abs().sum()) == 0, "the last block left counters set"
    assert vm.status.tolist() == [0] * len(vm.status), "status words (abort flag, exit count) not clear"
    assert (int(vm.token.item()), int(vm.pos.item())) == STEPS[-1], "the step's inputs were not stored"


def test_int_and_device_tensor_inputs_give_identical_steps():
    g, prog, vm = make("llama-tied-rope3", "f32", "default", max_seq=32)
    a = [vm.step(t, p).clone() for t, p in STEPS[:3]]
    vm.reset()
    dev = lambda v: torch.tensor([v], dtype=torch.int32, device=vm.device)  # noqa: E731
    b = [vm.step(dev(t), dev(p)).clone() for t, p in STEPS[:3]]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    vm.reset()
    vm.token.fill_(STEPS[0][0])                       # token from the buffer, position from the params
    c = vm.step(None, STEPS[0][1]).clone()
    assert torch.equal(c, a[0])


def test_aborted_launch_keeps_counters_for_the_report_then_host_clears_them():
    g, prog, vm = make("llama-untied", "f32", "default")
    k = next(i for i, t in enumerate(prog.tasks) if t.op == "GEMV_SILU_MUL")
    good = int(vm.instrs_np[k]["op"])
    vm.patch_instr(k, op=99)
    vm.step(5, 0, check=False)
    vm.step(6, 1, check=False)                          # sticky: exits at once
    torch.cuda.synchronize()
    assert int(vm.status[5]) == 1, "abort flag not raised"
    assert int(vm.counters.abs().sum()) > 0, "an aborted launch must leave its counters for the report"
    with pytest.raises(RuntimeError, match=r"unknown opcode 99"):
        vm.check_status()
    assert int(vm.sync.abs().sum()) == 0, "check_status must clear counters and status after reporting"
    vm.patch_instr(k, op=good)
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(vm.step(5, 0), ref.step(5, 0)) <= 1e-5


def test_one_stream_operation_per_step():
    g, prog, vm = make("llama-untied", "f32", "default", max_seq=32)
    vm.step(1, 0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for tok, pos in STEPS:
            vm.step(tok, pos, check=False)
        torch.cuda.synchronize()
    vm.check_status()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    mk = [n for n in names if "amk_megakernel" in n]
    assert len(mk) == len(STEPS), names
    assert len(names) == len(STEPS), f"extra stream operations per step: {sorted(set(names) - set(mk))}"


def test_out_of_range_int_inputs_are_refused_before_launch():
    g, prog, vm = make("llama-untied", "f32", "default", max_seq=32)
    with pytest.raises(RuntimeError, match=r"token 4294967296 is outside int32"):
        vm.step(2**32, 0)
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(vm.step(4, 0), ref.step(4, 0)) <= 1e-5


def test_trace_step_records_queue_and_physical_sm():
    """trace_step: every task's record names the queue that ran it (the program's own assignment) and the physical
    SM its block sat on; one block per SM, so within a step the queues sit on distinct SMs, each queue on one."""
    g, prog, vm = make("llama-untied", "f32", "default", max_seq=32)
    ref = ReferenceVM(prog, g.weights)
    want = ref.step(5, 0)
    tr = vm.trace_step(5, 0)
    assert rel_err(vm.logits, want) <= 1e-5, "a traced step must compute the same step"
    qsm = [t.sm for t in prog.tasks]
    assert tr["sm"].tolist() == qsm
    n_sm = torch.cuda.get_device_properties(vm.device).multi_processor_count
    smid = tr["smid"]
    assert smid.min() >= 0 and smid.max() < 4 * n_sm, f"implausible %smid values {smid.min()}..{smid.max()}"
    per_queue = {}
    for q, s in zip(qsm, smid.tolist()):
        per_queue.setdefault(q, set()).add(s)
    assert all(len(v) == 1 for v in per_queue.values()), "a block changed SM inside one launch"
    phys = [next(iter(v)) for v in per_queue.values()]
    assert len(set(phys)) == len(phys), "two queues' blocks shared one SM"
    assert (tr["t2"] >= tr["t1"]).all() and (tr["t1"] >= tr["t0"]).all()
