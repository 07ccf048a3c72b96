"""Device script (issue 4): what a decode step costs outside the megakernel itself.

    python scripts/launch_gaps.py llama-3.2-1b --ctx 512 [--config '{}'] [--steps 40]

A timed step (eval.bench.time_vm) is `vm.step(token, pos, check=False)`. Until the twenty-second session that was
four stream operations (fill token, fill pos, zero the counters + status, launch); since then it is one launch (the
kernel's last block resets the counters, token / pos travel in the params; amk_exit in megakernel.cu). This script
times (CUDA events, median of 7) the step, records steps under torch.profiler (CUPTI kernel timestamps) and prints
the megakernel's own duration against the start-to-start period of consecutive megakernels, the gap between them,
and every stream operation that ran in one gap. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.baselines import cuda_time_us  # noqa: E402
from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--config", default="{}")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    from vm.loader import MegakernelVM
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    prog = lower(g, get_target("auto"), json.loads(a.config), max_seq=bench_max_seq(a.ctx))
    vm = MegakernelVM(prog, g.weights)
    chk = check_program(vm, g, 4)
    print(json.dumps({"correct": chk["correct"], "max_rel_err": chk["max_rel_err"]}), flush=True)
    if not chk["correct"]:
        raise SystemExit("the program does not match transformers: not timed")
    vm.step(1, a.ctx)
    rows = {}
    rows["step (time_vm: vm.step(token, ctx, check=False))"] = time_vm(vm, g.config.vocab, a.ctx)["us"]
    rows["launch_async() alone (token, pos unchanged)"] = cuda_time_us(lambda: vm.launch_async(), iters=50,
                                                                       repeats=7, warmup=5)["us"]
    toks = torch.randint(0, g.config.vocab, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    it = iter(range(10 ** 9))

    def old_style():  # the step before this session: fill token, fill pos, zero counters + status, then launch
        vm._set(vm.token, toks[next(it) % 50])
        vm._set(vm.pos, a.ctx)
        vm.reset_sync()
        vm.launch_async()
    rows["old-style step (fill, fill, memset, launch)"] = cuda_time_us(old_style, iters=50, repeats=7, warmup=5)["us"]
    vm.check_status()

    toks = list(range(1, a.steps + 1))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for t in toks:
            vm.step(t, a.ctx, check=False)
        torch.cuda.synchronize()
    vm.check_status()
    ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                key=lambda e: e.time_range.start)
    mk = [e for e in ev if "amk_megakernel" in e.name]
    durs = [e.time_range.end - e.time_range.start for e in mk]
    periods = [b.time_range.start - a_.time_range.start for a_, b in zip(mk, mk[1:])]
    gaps = [b.time_range.start - a_.time_range.end for a_, b in zip(mk, mk[1:])]
    between = []
    for a_, b in zip(mk[5:6], mk[6:7]):  # what ran between two megakernels (names and durations, us)
        between = [(e.name[:60], round(e.time_range.end - e.time_range.start, 2),
                    round(e.time_range.start - a_.time_range.end, 2))
                   for e in ev if a_.time_range.end <= e.time_range.start < b.time_range.start]
    med = statistics.median
    rows["profiler: megakernel duration"] = med(durs[2:])
    rows["profiler: megakernel start-to-start period"] = med(periods[2:])
    rows["profiler: gap (end of one megakernel -> start of the next)"] = med(gaps[2:])
    print(json.dumps({"between_two_steps (name, dur_us, start_after_prev_end_us)": between}), flush=True)
    print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}")
    print("| what | us |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
