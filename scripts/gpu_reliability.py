"""Device script (issue 7): the GPU never hangs. Validator-bypassed bad programs on the real megakernel.

    python scripts/gpu_reliability.py                 # deadlocks + race + recovery table
    python scripts/gpu_reliability.py --sanitize toy  # one short run for compute-sanitizer (memcheck / racecheck)
    python scripts/gpu_reliability.py --sanitize llama2l

Cases: (1) a wait threshold one above its producer count, (2) a cross-SM cycle (EMBED waits on the logits counter),
(3) a race: an attention task with its wait dropped. Each bad program must end within ~2 s (deadlocks: a timeout
error naming task and counter) and the next launch of the valid program must match the reference again.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schedule.graph import PRESETS, ModelGraph, load_model, random_weights  # noqa: E402
from schedule.ir import get_target, validate  # noqa: E402
from schedule.lower import lower  # noqa: E402
from vm.loader import MegakernelError, MegakernelVM  # noqa: E402
from vm.reference_vm import ReferenceVM  # noqa: E402


def llama_2layer(dtype="bf16") -> ModelGraph:
    c = dataclasses.replace(PRESETS["llama-3.2-1b"], n_layers=2)
    return ModelGraph("llama-3.2-1b-2layer", c, random_weights(c, dtype, 0, "cuda"), dtype)


def rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).abs().max() / b.abs().max())


def run_case(name, prog, graph, ref_logits, good_vm, rows, expect_error):
    t0 = time.perf_counter()
    err, out = None, None
    try:
        vm = MegakernelVM(prog, graph.weights, check=False, timeout_s=2.0)
        out = vm.step(5, 0)
        torch.cuda.synchronize()
    except MegakernelError as e:
        err = str(e).splitlines()[0]
    dt = time.perf_counter() - t0
    good_vm.reset()
    after = rel(good_vm.step(5, 0), ref_logits)
    res = validate(prog)
    bad_out = None if out is None else rel(out, ref_logits)
    ok = (err is not None if expect_error else True) and after < 1e-5 and not res.ok and dt < 10
    rows.append((name, "PASS" if ok else "FAIL",
                 f"validator rejects: {not res.ok}; ended in {dt:.2f} s; "
                 + (f"error: {err[:90]}" if err else f"completed, output rel err vs reference {bad_out:.2e}")
                 + f"; next valid launch rel err {after:.1e}"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sanitize", choices=["toy", "llama2l"])
    a = ap.parse_args()
    target = get_target("auto")
    if a.sanitize:
        g = load_model("toy", dtype="f32", device="cuda") if a.sanitize == "toy" else llama_2layer()
        prog = lower(g, target, {}, max_seq=64)
        vm = MegakernelVM(prog, g.weights, timeout_s=600.0)
        for i, t in enumerate([3, 17]):
            vm.step(t, i)
        torch.cuda.synchronize()
        print(f"sanitize run done: {g.name}, {len(prog.tasks)} tasks, 2 steps")
        return
    g = load_model("toy", dtype="f32", device="cuda")
    prog = lower(g, target, {"num_sms": 8, "attn_splits": 1}, max_seq=32)
    ref = ReferenceVM(prog, {k: v.cpu() for k, v in g.weights.items()}).step(5, 0)
    good = MegakernelVM(prog, g.weights)
    rows = [("valid program", "PASS" if rel(good.step(5, 0), ref) < 1e-5 else "FAIL", "baseline")]

    p1 = copy.deepcopy(prog)
    t = next(t for t in p1.tasks if t.op == "ATTN_DECODE")
    t.waits[0].threshold += 1
    run_case("deadlock: threshold +1", p1, g, ref, good, rows, expect_error=True)

    p2 = copy.deepcopy(prog)
    emb = next(t for t in p2.tasks if t.op == "EMBED")
    logits_c = next(t.out_counter for t in p2.tasks if t.op == "GEMV" and t.label.startswith("lm_head"))
    from schedule.ir import Wait
    emb.waits.append(Wait(logits_c, sum(1 for t in p2.tasks if t.out_counter == logits_c)))
    run_case("deadlock: cycle across SMs", p2, g, ref, good, rows, expect_error=True)

    p3 = copy.deepcopy(prog)
    t = next(t for t in p3.tasks if t.op == "ATTN_DECODE")
    t.waits = []
    run_case("race: attention wait dropped", p3, g, ref, good, rows, expect_error=False)

    print(f"\n== GPU no-hang checks on {torch.cuda.get_device_name()} ({time.strftime('%Y-%m-%d')})")
    for r in rows:
        print(f"{r[0]:32s} {r[1]:5s} {r[2]}")


if __name__ == "__main__":
    main()
