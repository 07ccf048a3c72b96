"""Device script (issue 4): does the same program time differently depending on where its buffers landed, or on
what ran before it? (The twenty-second session saw one default llama-3.2-1b program at 1046.7 us in a one-VM
process and 993.0 us in an ab_builds process on the same H200.)

    python scripts/placement_probe.py llama-3.2-1b --ctx 512 [--vms 3] [--rounds 3]

Builds --vms copies of the default program's VM in one process (same weights tensors, their own activations, KV
caches and counters), times VM 0 alone first, then every VM round-robin --rounds times (time_vm each), and prints
per VM its median and the addresses of its counters / first activation. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import BufferKind, get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--vms", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default="{}")
    ap.add_argument("--staged", action="store_true",
                    help="instead: time VM 0 (3 rounds), build + check VM 1, time VM 0 again with VM 1 idle, then VM 1, "
                         "then VM 0 once more")
    ap.add_argument("--ramp", type=float, default=0.0,
                    help="also: idle this many seconds, then time 40 back-to-back batches of 25 steps (the warm-up)")
    a = ap.parse_args()
    from vm.loader import MegakernelVM
    g = load_model(a.model, dtype="bf16", device="cuda")
    prog = lower(g, get_target("auto"), json.loads(a.config), max_seq=bench_max_seq(a.ctx))
    first_act = next(b.id for b in prog.buffers if b.kind == BufferKind.ACTIVATION)
    vms, first = [], {}
    if a.staged:
        tv = lambda vm: [round(time_vm(vm, g.config.vocab, a.ctx, iters=30, repeats=3)["us"], 1)  # noqa: E731
                         for _ in range(3)]
        v0 = MegakernelVM(prog, g.weights)
        assert check_program(v0, g, 2)["correct"]
        rows = [("VM 0 alone", tv(v0))]
        v1 = MegakernelVM(prog, g.weights)
        assert check_program(v1, g, 2)["correct"]
        rows += [("VM 0 after VM 1 was built and checked", tv(v0)), ("VM 1", tv(v1)), ("VM 0 again", tv(v0))]
        print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}, staged")
        print("| step | us (3 x 30 steps) |\n|---|---|")
        for k, v in rows:
            print(f"| {k} | {', '.join(map(str, v))} |")
        return
    for i in range(a.vms):
        vm = MegakernelVM(prog, g.weights)
        chk = check_program(vm, g, 2)
        assert chk["correct"], chk
        vms.append(vm)
        if i == 0:
            first["alone, right after its check"] = time_vm(vm, g.config.vocab, a.ctx)["us"]
    times = {i: [] for i in range(a.vms)}
    for _ in range(a.rounds):
        for i, vm in enumerate(vms):
            times[i].append(time_vm(vm, g.config.vocab, a.ctx, iters=30, repeats=3)["us"])
    if a.ramp > 0:
        import time
        torch.cuda.synchronize()
        time.sleep(a.ramp)
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(41)]
        evs[0].record()
        for b in range(40):
            for j in range(25):
                vms[0].step(1 + j, a.ctx, check=False)
            evs[b + 1].record()
        torch.cuda.synchronize()
        ramp = [evs[b].elapsed_time(evs[b + 1]) * 1e3 / 25 for b in range(40)]
        print(f"after {a.ramp:g} s idle, us/step per batch of 25: " + " ".join(f"{t:.0f}" for t in ramp))
    print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}, {a.vms} VMs of one program")
    print("| VM | median us | all | counters at | first activation at |\n|---|---|---|---|---|")
    for k, v in first.items():
        print(f"| 0 ({k}) | {v:.1f} | | | |")
    for i, vm in enumerate(vms):
        print(f"| {i} | {statistics.median(times[i]):.1f} | {', '.join(f'{t:.1f}' for t in times[i])} | "
              f"{vm.sync.data_ptr():#x} | {vm.tensors[first_act].data_ptr():#x} |")


if __name__ == "__main__":
    main()
