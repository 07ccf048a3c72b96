"""flag_hops (schedule/flags.py) and the validator's section 6: which buffers and waits are flagged, the program's
semantics are unchanged (the CPU reference gives the same logits), the device tables carry the flags, and every
rule is enforced -- a flagged buffer in a slot the kernel reads as plain fp32, a second write of a flagged element,
a flagged read whose writer is no dependency ancestor, a data wait taken for a memory edge.
"""
from __future__ import annotations

import copy

import pytest
import torch

from schedule.graph import load_model
from schedule.ir import TARGETS, MegakernelProgram
from schedule.lower import lower
from schedule.validate import validate
from vm import abi
from vm.reference_vm import ReferenceVM

TOY = load_model("toy", dtype="f32")


def _prog(which="all", **cfg) -> MegakernelProgram:
    return lower(TOY, TARGETS["h100"], {"num_sms": 16, **cfg, "flag_hops": which}, max_seq=32)


def _errors(p) -> str:
    r = validate(p)
    assert not r.ok
    return "\n".join(r.errors)


@pytest.mark.parametrize("which", ["all", "residual", "residual_attn"])
def test_flagged_programs_validate_and_compute_the_same(which):
    p, base = _prog(which), _prog("off")
    assert validate(p).ok
    assert any(b.flagged for b in p.buffers) and not any(b.flagged for b in base.buffers)
    # the same tasks, queues and counters: only buffer flags and wait kinds differ
    assert [t.op for t in p.tasks] == [t.op for t in base.tasks] and p.queues == base.queues
    a, b = ReferenceVM(p, TOY.weights, seed=5), ReferenceVM(base, TOY.weights, seed=5)
    for tok, pos in [(3, 0), (11, 1), (7, 2)]:
        assert torch.equal(a.step(tok, pos), b.step(tok, pos))
    # JSON round trip keeps both
    q = MegakernelProgram.from_json(p.to_json())
    assert [bb.flagged for bb in q.buffers] == [bb.flagged for bb in p.buffers]
    assert [[w.data for w in t.waits] for t in q.tasks] == [[w.data for w in t.waits] for t in p.tasks]


def test_device_tables_carry_the_flags():
    from vm import jit
    from vm.pack import device_code, pack_buffers, pack_instructions
    p = _prog("all")
    ins = pack_instructions(p)
    for i, t in enumerate(p.tasks):
        want = sum(abi.INSTR_FLAG_WAIT_DATA0 << k for k, w in enumerate(t.waits) if w.data)
        assert int(ins[i]["flags"]) & (0xF * abi.INSTR_FLAG_WAIT_DATA0) == want
    bufs = pack_buffers(p, lambda i: 4096 * (i + 1))
    for b in p.buffers:
        assert bufs[b.id]["dtype"] == abi.DTYPE_CODES["f32x" if b.flagged else device_code(b)]
    assert abi.DTYPE_BYTES["f32x"] == 8
    assert "-DAMK_FLAGS=1" in jit.spec_for(arch="sm_90a", flags=True).cuda_cflags()
    assert "-DAMK_FLAGS=0" in jit.spec_for(arch="sm_90a").cuda_cflags()
    assert jit.spec_for(arch="sm_90a", flags=True).digest() != jit.spec_for(arch="sm_90a").digest()


def test_flags_skip_what_the_kernel_cannot_flag():
    """fuse_down's fused tiles read the residual stream and accumulate into it: none of it is flagged there, and
    o_proj_by_group's accumulated x neither; the program stays valid."""
    p = _prog("all", fuse_down=True)
    assert validate(p).ok
    names = {b.name for b in p.buffers if b.flagged}
    assert not any(n.startswith(("x", "xmid")) for n in names), names
    q = _prog("all", o_proj_by_group=True)
    assert validate(q).ok
    assert not any(b.flagged and b.name.startswith("xmid") for b in q.buffers)


def test_flag_in_a_plain_slot_is_refused():
    p = _prog("all")
    q = next(b for b in p.buffers if b.name == "q0")   # QKV_ROPE's dst: the kernel stores plain fp32 there
    q.flagged = True
    assert "slot 'dst'" in _errors(p)


def test_flag_on_a_weight_is_refused():
    p = _prog("all")
    next(b for b in p.buffers if b.kind.value == "weight").flagged = True
    assert "only fp32 ACTIVATION" in _errors(p)


def test_second_write_of_a_flagged_element_is_refused():
    p = _prog("all")
    o = [t for t in p.tasks if t.label.startswith("L0.o_proj[")]
    o[1].params["row_start"] = o[0].params["row_start"]   # two tiles write the same rows of xmid0
    assert "written once per launch" in _errors(p)


def test_flagged_read_without_a_dependency_is_refused():
    p = _prog("all")
    g = next(t for t in p.tasks if t.label.startswith("L0.gate_up[") and p.queues[t.sm].index(t.id) < 3)
    g.waits = []   # it still polls xmid0, whose o_proj writers are no ancestors of it now
    assert "could wait forever" in _errors(p)


def test_data_wait_is_no_memory_edge():
    """A data wait orders only the flagged words the task polls: with xmid0 unflagged but the gate/up waits left
    as data waits, their reads of xmid0 are unordered (a race), and a data wait that polls nothing is refused."""
    p = _prog("all")
    next(b for b in p.buffers if b.name == "xmid0").flagged = False
    errs = _errors(p)
    assert "reads no data-flagged buffer" in errs
    assert "race" in errs and "xmid0" in errs
    ok = copy.deepcopy(_prog("all"))
    for t in ok.tasks:   # the same program with every data wait a plain one: still valid (counters order it all)
        for w in t.waits:
            w.data = False
    assert validate(ok).ok


def test_flags_the_validator_refuses_fail_the_lowering():
    """A two-step launch orders step 1's KV appends after step 0's attention through the whole step in between;
    with h flagged (a data wait inside that chain) that order is gone: lowering fails naming the knob, and the
    harness reports it as REJECTED on field flag_hops. The smaller choice lowers and validates."""
    from schedule.ir import IRError
    with pytest.raises(IRError, match=r"flag_hops='all'.*write-after-read"):
        _prog("all", steps_per_launch=2)
    assert validate(_prog("residual", steps_per_launch=2)).ok
    from harness import evaluate
    v = evaluate("toy", "h100", {"steps_per_launch": 2, "flag_hops": "all"}, device="cpu", ctx=8)
    assert v["status"] == "REJECTED" and v["rejected_field"] == "flag_hops", v["rejected_reason"]
