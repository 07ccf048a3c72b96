"""Claim groups (GEMV_SILU_MUL dyn_rows > 0, knob dyn_mlp_rows): the members of a group split the gate/up rows at
run time through a ticket counter. The validator accepts exactly the well-formed groups (identical members but for
dyn_index, indices 0..n-1, a claim counter nobody waits on or signals) and still finds races around them; the
reference VM's random partitions all give transformers' logits; the cost model and the loader see a member's share.
"""
from __future__ import annotations

import copy

import pytest
import torch

from eval.equivalence import verify_steps
from schedule.cost_model import task_bytes
from schedule.ir import TARGETS, Wait, validate
from schedule.lower import lower
from schedule.ops import dyn_first_rows, dyn_ticket_rows, dyn_tickets, weight_ranges
from tests.conftest import small_graph
from vm.reference_vm import ReferenceVM

H100 = TARGETS["h100"]


def _prog(rows=32, sms=7, family="llama-untied", static=0):
    g = small_graph(family, seed=3)
    return g, lower(g, H100, {"dyn_mlp_rows": rows, "num_sms": sms, "dyn_mlp_static": static}, max_seq=24)


def _members(p, layer=0):
    return [t for t in p.tasks if t.op == "GEMV_SILU_MUL" and t.label.startswith(f"L{layer}.")]


def test_group_shape_partial_last_chunk():
    g, p = _prog(rows=32, sms=7)      # 176 rows in chunks of 32: 6 chunks (the last one 16 rows), 6 members
    m = _members(p)
    assert len(m) == 6 and [dyn_tickets(t.params) for t in m] == [0] * 6   # every chunk is some member's own
    assert [dyn_first_rows(t.params) for t in sorted(m, key=lambda t: t.params["dyn_index"])] == \
        [(0, 32), (32, 32), (64, 32), (96, 32), (128, 32), (160, 16)]
    assert validate(p).ok


def test_own_tiles_then_tickets():
    g, p = _prog(rows=4, sms=7, static=75)   # 176 // 7 = 25 rows each, 75 % -> 18 -> 16: own 7 x 16, then 64 rows
    m = sorted(_members(p), key=lambda t: t.params["dyn_index"])
    assert len(m) == 7 and {t.params["dyn_static"] for t in m} == {16}
    assert [dyn_first_rows(t.params) for t in m] == [(16 * j, 16) for j in range(7)]
    assert dyn_tickets(m[0].params) == 16
    assert [dyn_ticket_rows(m[0].params, t) for t in (0, 15)] == [(112, 4), (172, 4)]
    assert validate(p).ok
    g, p = _prog(rows=8, sms=7, static=100)  # 24 rows each (100 %, a multiple of 4): own 168, one chunk of 8 left
    m = _members(p)
    assert {t.params["dyn_static"] for t in m} == {24} and dyn_tickets(m[0].params) == 1


def test_member_share_in_cost_and_prefetch_ranges():
    g, p = _prog(rows=32, sms=7)
    t = _members(p)[2]
    K = t.params["k"]
    numel = lambda b: p.buffers[b].numel  # noqa: E731
    rng = {a.slot: (a.lo, a.hi) for a in weight_ranges(t, numel)}
    j0, jn = dyn_first_rows(t.params)
    assert rng["w_gate"] == rng["w_up"] == (j0 * K, (j0 + jn) * K)        # its own chunk: what it may prefetch
    assert task_bytes(p, t, 8) == -(-2 * 176 * K * 4 // 6)                 # its even share of both matrices (fp32)
    assert t.est_bytes < 2 * 176 * K * 4 // 5


@pytest.mark.parametrize("family", ["llama-untied", "qwen3", "mistral-window"])
@pytest.mark.parametrize("rows,sms,static", [(32, 7, 0), (4, 5, 0), (8, 132, 0), (4, 7, 75), (8, 5, 90), (1, 5, 75)])
def test_random_partitions_match_transformers(family, rows, sms, static):
    g, p = _prog(rows, sms, family, static)
    toks = torch.randint(0, g.config.vocab, (6,), generator=torch.Generator().manual_seed(rows)).tolist()
    outs = []
    for seed in (0, 1):
        vm = ReferenceVM(p, g.weights, seed=seed)
        res = verify_steps(vm.step, g.hf_model(), toks, "f32")
        assert res["max_rel_err"] <= 1e-4 and res["top1_agreement"] == 1.0, res
        vm.reset()
        outs.append(vm.step(toks[0], 0))
    assert torch.allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_reference_vm_partitions_vary_and_cover_every_chunk():
    g, p = _prog(rows=4, sms=7)       # 44 chunks over 7 members
    ids = {t.id for t in _members(p)}
    parts = set()
    for seed in range(4):
        vm = ReferenceVM(p, g.weights, seed=seed)
        vm.step(1, 0)
        assert vm.claims[_members(p)[0].params["dyn_claim"]] == [44 - 7, 7]   # every ticket drawn, each member once
        log = [(tid, rs) for tid, rs in vm.claim_log if tid in ids]
        rows = sorted(r for _, rs in log for a, n in rs for r in range(a, a + n))
        assert rows == list(range(176))                                        # each row exactly once
        assert all(rs[0] == (4 * p.tasks[tid].params["dyn_index"], 4) for tid, rs in log)   # own chunk first
        parts.add(tuple(sorted((tid, len(rs)) for tid, rs in log)))
    assert len(parts) > 1, "the random draws should move the partition"


def _errors(p) -> str:
    r = validate(p)
    assert not r.ok
    return " | ".join(r.errors)


def test_rejects_members_that_differ():
    g, p = _prog()
    q = copy.deepcopy(p)
    _members(q)[1].params["dyn_rows"] = 16
    assert "claim-group" in _errors(q) or "differ in more than dyn_index" in _errors(q)


def test_rejects_missing_or_repeated_index():
    g, p = _prog()
    q = copy.deepcopy(p)
    _members(q)[1].params["dyn_index"] = 0
    assert "expected each of 0..5 once" in _errors(q)


def test_rejects_index_out_of_range():
    g, p = _prog()
    q = copy.deepcopy(p)
    _members(q)[1].params["dyn_index"] = 9
    assert "dyn_index 9 outside [0, dyn_tasks=6)" in _errors(q)


def test_rejects_a_wait_on_the_claim_counter():
    g, p = _prog()
    q = copy.deepcopy(p)
    claim = _members(q)[0].params["dyn_claim"]
    down = next(t for t in q.tasks if t.label.startswith("L0.down"))
    down.waits.append(Wait(claim, 1))
    assert "claim counter only hands out tickets" in _errors(q) or "no task signals" in _errors(q)


def test_two_groups_on_one_range_race():
    """Each group is exempt only from its own members: split one group's members over two claim counters and
    the two halves are unordered writers of the same rows."""
    g, p = _prog()
    q = copy.deepcopy(p)
    other = len(q.counters)
    from schedule.ir import Counter
    q.counters.append(Counter(other, "claim_other"))
    ms = sorted(_members(q), key=lambda t: t.params["dyn_index"])
    for t in ms[3:]:
        t.params["dyn_claim"] = other
        t.params["dyn_tasks"] = 3
        t.params["dyn_index"] -= 3
    for t in ms[:3]:
        t.params["dyn_tasks"] = 3
    assert "unordered writers" in _errors(q)


def test_reader_before_the_group_is_a_race():
    """A consumer that waits for only part of the group reads rows another member may still write."""
    g, p = _prog()
    q = copy.deepcopy(p)
    down = next(t for t in q.tasks if t.label.startswith("L0.down"))
    claim_out = _members(q)[0].out_counter
    w = next(w for w in down.waits if w.counter == claim_out)
    w.threshold -= 1
    assert "under-counted wait" in _errors(q)


def test_static_params_without_dyn_rows_are_rejected():
    g, p = _prog()
    q = lower(g, H100, {"num_sms": 7}, max_seq=24)
    t = next(t for t in q.tasks if t.op == "GEMV_SILU_MUL")
    t.params["dyn_index"] = 2
    assert "(dyn_index / dyn_tasks / dyn_claim / dyn_static only with it)" in _errors(q)
