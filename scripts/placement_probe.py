"""Device script (issue 4): does the same program time differently depending on where its buffers landed, or on
what ran before it? (The twenty-second session saw one default llama-3.2-1b program at 1046.7 us in a one-VM
process and 993.0 us in an ab_builds process on the same H200.)

    python scripts/placement_probe.py llama-3.2-1b --ctx 512 [--vms 3] [--rounds 3]

Builds --vms copies of the default program's VM in one process (same weights tensors, their own activations, KV
caches and counters), times VM 0 alone first, then every VM round-robin --rounds times (time_vm each), and prints
per VM its median and the addresses of its counters / first activation. Prints a table last.

    --staged             VM 0 alone, then with a second VM built and checked (the twenty-second session's lead)
    --triggers a,b,...   VM 0 timed after each step: idle, check, alloc[N], empty, fillsmall, readw, gemm, build,
                         checkv1, free (which foreign work moves the one-VM timing; twenty-third session)
    --pack ROUNDS        weights as loaded vs packed into one allocation, timed alternately after fills
    --profile-staged     VM 0 alone, then after VM 1 was built and checked: one step of VM 0 in each state inside
                         cudaProfilerStart/Stop, for `ncu --profile-from-start off --launch-count 2` (which counters
                         tell the two states apart; thirty-first session)
    --nvcc=FLAGS         build flags (e.g. --nvcc=-DAMK_SMEM_CARVEOUT=0; note the '=': the value starts with '-')

Twenty-third session (H100, docs/PERF.md): the one-VM timing moves between ~1155 and ~1210 us after foreign kernels
run, the same for every VM in the process and for packed weights; not the carve-out, not the buffers' placement.
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
    ap.add_argument("--nvcc", default="", help="extra nvcc flags of the build (e.g. -DAMK_SMEM_CARVEOUT=0)")
    ap.add_argument("--staged", action="store_true",
                    help="instead: time VM 0 (3 rounds), build + check VM 1, time VM 0 again with VM 1 idle, then VM 1, "
                         "then VM 0 once more")
    ap.add_argument("--triggers", default="",
                    help="instead: time VM 0 alone, then after each of these comma-separated steps in order: "
                         "idle (sleep 3 s), check (check_program on VM 0 again), alloc (fill a 2 GiB tensor), "
                         "build (build VM 1, no check), checkv1 (check VM 1), free (drop VM 1 + the dummy tensor), "
                         "empty (a 2 GiB tensor, not written), allocN (fill an N MiB tensor), fillsmall (fill one "
                         "64 MiB tensor 200 times), readw (sum every weight 20 times), gemm (20 bf16 4096^2 matmuls)")
    ap.add_argument("--pack", type=int, default=0, metavar="ROUNDS",
                    help="instead: VM A on the weights as loaded (one allocation each), VM B on a copy packed into "
                         "one allocation in program order; ROUNDS x (fill a fresh buffer, time A, time B)")
    ap.add_argument("--profile-staged", action="store_true",
                    help="instead: one step of VM 0 alone and one after VM 1 was built and checked, each inside "
                         "cudaProfilerStart/Stop (run under ncu --profile-from-start off)")
    ap.add_argument("--ramp", type=float, default=0.0,
                    help="also: idle this many seconds, then time 40 back-to-back batches of 25 steps (the warm-up)")
    a = ap.parse_args()
    if a.nvcc:
        from scripts.trace_breakdown import set_build_env
        set_build_env({"nvcc": a.nvcc})
    g = load_model(a.model, dtype="bf16", device="cuda")
    prog = lower(g, get_target("auto"), json.loads(a.config), max_seq=bench_max_seq(a.ctx))
    first_act = next(b.id for b in prog.buffers if b.kind == BufferKind.ACTIVATION)
    vms, first = [], {}
    tv = lambda vm: [round(time_vm(vm, g.config.vocab, a.ctx, iters=30, repeats=3)["us"], 1)  # noqa: E731
                     for _ in range(3)]
    if a.triggers:
        run_triggers(a, g, prog, tv)
        return
    if a.pack:
        run_pack(a, g, prog, tv)
        return
    if a.profile_staged:
        v0 = checked_vm(prog, g)
        t_alone = tv(v0)
        profiled_step(v0, a.ctx)
        v1 = checked_vm(prog, g)
        t_after = tv(v0)
        profiled_step(v0, a.ctx)
        print(f"VM 0 alone {t_alone} us; after VM 1 was built and checked {t_after} us (3 x 30 steps; "
              f"v1 at {v1.sync.data_ptr():#x}); profiled one step of VM 0 after each")
        return
    if a.staged:
        v0 = checked_vm(prog, g)
        rows = [("VM 0 alone", tv(v0))]
        v1 = checked_vm(prog, g)
        rows += [("VM 0 after VM 1 was built and checked", tv(v0)), ("VM 1", tv(v1)), ("VM 0 again", tv(v0))]
        print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}, staged")
        print("| step | us (3 x 30 steps) |\n|---|---|")
        for k, v in rows:
            print(f"| {k} | {', '.join(map(str, v))} |")
        return
    for i in range(a.vms):
        vm = checked_vm(prog, g)
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


def profiled_step(vm, ctx: int) -> None:
    """One decode step of ``vm`` at position ctx between cudaProfilerStart and cudaProfilerStop."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    vm.step(1, ctx, check=False)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def checked_vm(prog, g, weights=None):
    """A MegakernelVM of ``prog`` (on ``weights``, default the graph's) that passed check_program (2 steps)."""
    from vm.loader import MegakernelVM
    vm = MegakernelVM(prog, g.weights if weights is None else weights)
    chk = check_program(vm, g, 2)
    assert chk["correct"], chk
    return vm


def packed_weights(g, prog, align: int = 4096) -> dict:
    """The program's weights copied into one device allocation, in the order the program's buffers name them."""
    order = list(dict.fromkeys(b.source for b in prog.buffers if b.kind == BufferKind.WEIGHT))
    order += [k for k in g.weights if k not in order]
    offs, n = {}, 0
    for k in order:
        w = g.weights[k]
        offs[k] = n
        n += -(-w.numel() * w.element_size() // align) * align
    flat = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for k in order:
        w = g.weights[k]
        nb = w.numel() * w.element_size()
        out[k] = flat[offs[k]:offs[k] + nb].view(w.dtype).view(w.shape)
        out[k].copy_(w)
    print(f"packed {len(order)} weights, {n / 2**30:.2f} GiB at {flat.data_ptr():#x}")
    return out


def run_pack(a, g, prog, tv):
    """Same program, weights as loaded vs packed into one allocation: timed alternately after foreign kernels."""
    va = checked_vm(prog, g)
    vb = checked_vm(prog, g, packed_weights(g, prog))
    rows = []
    for r in range(a.pack):
        buf = torch.empty((64 + 96 * r) << 20, dtype=torch.uint8, device="cuda").fill_(r)
        del buf
        ta = tv(va)
        tb = tv(vb)
        rows.append((r, ta, tb))
    print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}, weights as loaded (A) vs packed (B)")
    print("| round | A us | B us |\n|---|---|---|")
    for r, ta, tb in rows:
        print(f"| {r} | {', '.join(map(str, ta))} | {', '.join(map(str, tb))} |")


def run_triggers(a, g, prog, tv):
    """Which step makes a lone VM faster? Time VM 0 after each step in --triggers."""
    import time
    from vm.loader import MegakernelVM
    v0 = checked_vm(prog, g)
    print(f"{time.time():.2f} timing VM 0 alone", flush=True)
    state, rows = {}, [("VM 0 alone", tv(v0))]
    for step in a.triggers.split(","):
        if step == "idle":
            torch.cuda.synchronize()
            time.sleep(3)
        elif step == "check":
            assert check_program(v0, g, 2)["correct"]
        elif step == "alloc":
            state["dummy"] = torch.empty(2 << 30, dtype=torch.uint8, device="cuda").fill_(7)
        elif step == "empty":
            state["dummy"] = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        elif step.startswith("alloc") and step[5:].isdigit():
            state["dummy"] = torch.empty(int(step[5:]) << 20, dtype=torch.uint8, device="cuda").fill_(7)
        elif step == "fillsmall":
            buf = state.setdefault("small", torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
            for i in range(200):
                buf.fill_(i)
        elif step == "readw":
            for _ in range(20):
                sum(float(torch.sum(w, dtype=torch.float32)) for w in g.weights.values())
        elif step == "gemm":   # cuBLAS GEMMs (kernels that ask for a large shared-memory carve-out)
            x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            for _ in range(20):
                x = (x @ x).clamp_(-1, 1)
        elif step == "build":
            state["v1"] = MegakernelVM(prog, g.weights)
        elif step == "checkv1":
            assert check_program(state["v1"], g, 2)["correct"]
        elif step == "free":
            state.clear()
            torch.cuda.empty_cache()
        else:
            raise SystemExit(f"unknown trigger step {step!r}")
        torch.cuda.synchronize()
        print(f"{time.time():.2f} timing after {step}", flush=True)
        rows.append((f"after {step}", tv(v0)))
    print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}, triggers {a.triggers}")
    print("| step | VM 0 us (3 x 30 steps) |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {', '.join(map(str, v))} |")


if __name__ == "__main__":
    main()
