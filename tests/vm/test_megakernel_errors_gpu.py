"""The GPU megakernel's robustness contract: an unknown opcode traps, a wait that never ends times out naming its
task and counter (the task loop's waits and the joined waits inside attention / merge ops), bad tokens and
positions are reported, a build without the program's element type refuses it, a drifted POD layout refuses to
launch, and a program that skipped validation still has its ranges checked -- and after each error the next
launch is correct (against the CPU ReferenceVM). All tests carry @pytest.mark.cuda.
"""
from __future__ import annotations

import copy
import time

import pytest

from schedule.ir import TARGETS
from schedule.lower import lower
from tests.vm.test_megakernel_gpu import CONFIGS, PATHS, _path, compare, graph, make, rel_err
from vm import abi
from vm.reference_vm import ReferenceVM

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("path", PATHS)
def test_trap_unknown_opcode_then_valid_launch(path):
    g, prog, vm = make("llama-untied", "f32", "default", **_path(path))
    ref = ReferenceVM(prog, g.weights)
    k = next(i for i, t in enumerate(prog.tasks) if t.op == "GEMV_SILU_MUL")
    good = int(vm.instrs_np[k]["op"])
    vm.patch_instr(k, op=99)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"unknown opcode 99") as ei:
        vm.step(5, 0)
    assert f"task {prog.tasks[k].id}" in str(ei.value)
    assert time.perf_counter() - t0 < 5.0
    vm.patch_instr(k, op=good)
    assert rel_err(vm.step(5, 0), ref.step(5, 0)) <= 1e-5


def test_timeout_names_task_and_counter_then_valid_launch():
    g, prog, _ = make("llama-untied", "f32", "default")
    bad = copy.deepcopy(prog)
    # the final argmax: nothing waits on it, so it is the only block that can time out (deterministic report)
    k = next(i for i, t in enumerate(bad.tasks) if t.op in ("ARGMAX", "ARGMAX_MERGE", "ARGMAX_PAIRS"))
    bad.tasks[k].waits[0].threshold += 1                 # never satisfied
    from vm.loader import MegakernelVM
    vm = MegakernelVM(bad, g.weights, check=False, timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"timeout") as ei:
        vm.step(5, 0)
    dt = time.perf_counter() - t0
    msg = str(ei.value)
    assert f"task {bad.tasks[k].id}" in msg and f"counter {bad.tasks[k].waits[0].counter}" in msg, msg
    assert dt < 3.0, f"timeout took {dt:.2f} s"
    thr = vm.instrs_np[k]["wait_threshold"].copy()
    thr[0] -= 1
    vm.patch_instr(k, wait_threshold=thr)
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(vm.step(5, 0), ref.step(5, 0)) <= 1e-5


def _never_done(prog, k: int) -> set[int]:
    """Task ids that cannot finish once task k never does: k, every later task of a queue holding one of them, and
    every task waiting on a counter one of them signals (each wait's threshold counts all its producers)."""
    by_sm: dict[int, list] = {}
    for t in prog.tasks:
        by_sm.setdefault(t.sm, []).append(t)
    stuck, grew = {prog.tasks[k].id}, True
    while grew:
        grew = False
        dead = {t.out_counter for t in prog.tasks if t.id in stuck and t.out_counter >= 0}
        for q in by_sm.values():
            hit = False
            for t in q:
                hit = hit or t.id in stuck or any(w.counter in dead for w in t.waits)
                if hit and t.id not in stuck:
                    stuck.add(t.id)
                    grew = True
    return stuck


@pytest.mark.parametrize("name,dtype,op", [("llama-untied", "f32", "ATTN_PARTIAL"), ("wide", "bf16", "ATTN_PARTIAL"),
                                           ("llama-untied", "f32", "ATTN_MERGE")])
def test_joined_wait_times_out_then_valid_launch(name, dtype, op):
    """Attention and merge tasks wait inside their op (AMK_JOIN_OPS, vm/csrc/sync.cuh): one whose counter never
    arrives still ends the launch with a TIMEOUT (the generic f32 body and the bf16 tensor-core body), naming a task
    that cannot finish and one of its counters, and the next launch is correct."""
    from vm.loader import MegakernelVM
    g, prog, _ = make(name, dtype, "split", max_seq=16)   # wide: head_dim 128, the tensor-core body
    bad = copy.deepcopy(prog)
    k = next(i for i, t in enumerate(bad.tasks) if t.op == op)
    bad.tasks[k].waits[0].threshold += 1                 # never satisfied
    stuck = _never_done(bad, k)
    vm = MegakernelVM(bad, g.weights, check=False, timeout_s=0.5)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"timeout") as ei:
        vm.step(5, 0)
    assert time.perf_counter() - t0 < 3.0
    msg = str(ei.value)
    named = [t for t in bad.tasks if f"task {t.id} " in msg + " " and t.id in stuck]
    assert named and any(f"counter {w.counter} (" in msg for w in named[0].waits), msg
    thr = vm.instrs_np[k]["wait_threshold"].copy()
    thr[0] -= 1
    vm.patch_instr(k, wait_threshold=thr)
    compare(vm, ReferenceVM(prog, g.weights), [(5, 0), (7, 1)], 1e-5 if dtype == "f32" else 2e-2)


def test_bad_token_and_position_are_reported():
    g, prog, vm = make("llama-untied", "f32", "default", max_seq=16)
    with pytest.raises(RuntimeError, match=r"token id 100000"):
        vm.step(100000, 0)
    with pytest.raises(RuntimeError, match=r"position 16"):
        vm.step(1, 16)
    with pytest.raises(RuntimeError, match=r"position -1"):
        vm.step(1, -1)
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(vm.step(1, 0), ref.step(1, 0)) <= 1e-5


def test_build_without_the_programs_dtype_reports_it_then_valid_launch(monkeypatch):
    from vm import jit
    g, prog, vm = make("llama-untied", "f32", "default")
    assert vm.build_info["dtypes"] == 1 << abi.DTYPE_CODES["f32"]   # built for the program's type only
    monkeypatch.setattr(jit, "dtype_mask", lambda names: 1 << abi.DTYPE_CODES["bf16"])
    from vm.loader import MegakernelVM
    wrong = MegakernelVM(prog, g.weights)
    with pytest.raises(RuntimeError, match=r"no code for element type f32"):
        wrong.step(5, 0)
    ref = ReferenceVM(prog, g.weights)
    assert rel_err(vm.step(5, 0), ref.step(5, 0)) <= 1e-5


def test_layout_drift_refuses_launch(monkeypatch):
    from vm import loader
    real = abi.layout_table()

    def drifted():
        d = copy.deepcopy(real)
        d["AmkInstr"]["fp"] += 4
        return d
    monkeypatch.setattr(loader.abi, "layout_table", drifted)
    with pytest.raises(loader.AbiMismatchError, match=r"AmkInstr\.fp"):
        make("llama-untied", "f32", "default")


def test_program_without_validation_still_checks_ranges():
    from vm.loader import MegakernelError, MegakernelVM
    g = graph("llama-untied")
    prog = lower(g, TARGETS["h100"], CONFIGS["default"], max_seq=16)
    bad = copy.deepcopy(prog)
    t = next(t for t in bad.tasks if t.op == "GEMV")
    t.params["row_start"] = 10 ** 6
    with pytest.raises(MegakernelError, match=rf"task {t.id} \(GEMV\)"):
        MegakernelVM(bad, g.weights, check=False)
