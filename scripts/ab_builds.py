"""Device script (issue 4): interleaved A/B timing of build and schedule variants in ONE process.

    python scripts/ab_builds.py llama-3.2-1b --ctx 512 --rounds 7 \\
        --variants 'base={}' 'bf16={"nvcc":"-DAMK_DTYPES=2"}'

The lent GPUs differ by up to 10% between machines, so a speed claim compares variants timed side by side: every
variant is built (its own cached extension), checked against transformers (eval.bench.check_program; a wrong
variant is never timed), then the variants are timed round-robin, `--rounds` times each (CUDA events, one median of
`--iters` steps per round). Variants use trace_breakdown.py's NAME=JSON syntax (schedule keys + tma / stages /
stage_bytes / nvcc build keys). Prints a table last (median, min, max, ratio to the first variant); JSON to $OUT.
`--jobs N` builds the variants' extensions in N worker processes first (4 builds: ~40 s instead of ~4 min on a
fresh device machine), so a multi-build A/B fits one device call.

`--pads 0,4,8,12` times every variant in several code layouts: variant NAME becomes NAME@P for each P, built with
-DAMK_LAYOUT_PAD=P (P never-executed loads at the top of the kernel body, which move every op function; the
layout alone moves a step by +-1-2.5%, docs/PERF.md, twenty-ninth session). The last table then gives each
variant's mean over its layouts: kernel changes of 1-2% need it.

A variant named `diag:NAME` is a diagnostic build whose results are knowingly wrong (e.g. nvcc -DAMK_DBG_NOWAIT=1:
no task waits for its inputs). It is timed WITHOUT the correctness gate and printed as a bound, never as a latency.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from eval.equivalence import describe_misses  # noqa: E402
from eval.roofline import roofline  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target, validate  # noqa: E402
from schedule.lower import lower  # noqa: E402
from scripts.trace_breakdown import parse_variant, set_build_env, variant_parser  # noqa: E402
from vm.loader import MegakernelVM, select_build  # noqa: E402


def _prebuild(model: str, dtype: str, ctx: int, variant: str) -> str:
    """In a worker process: build (or find cached) the extension one variant needs, chosen as the timing process's
    MegakernelVM will (vm.loader.select_build: no weights are loaded). Returns a one-line status."""
    import torch
    from vm import jit
    name, cfg, build = parse_variant(variant)
    set_build_env(build)
    try:
        prog = lower(load_model(model, dtype=dtype), get_target("auto"), cfg, max_seq=bench_max_seq(ctx))
        threads, depth = jit.knobs_from_config(prog.config)
        dev = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(dev):
            jit.build(select_build(prog, dev, threads, depth).spec)
        return f"{name}: built"
    except Exception as e:  # the timing pass reports it again, per variant
        return f"{name}: {type(e).__name__}: {str(e)[:200]}"


def prebuild(a) -> None:
    """Build every variant's extension in parallel worker processes (--jobs): one nvcc build takes ~1 min, so a
    4-variant A/B otherwise spends most of a device call compiling one build after another. The workers load no
    weights (lowering needs only the model's shapes), so any model size fits."""
    import concurrent.futures
    import multiprocessing
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for r in ex.map(_prebuild, *zip(*[(a.model, a.dtype, a.ctx, v) for v in a.variants])):
            print("prebuild", r, flush=True)
    print(f"prebuild: {len(a.variants)} variants in {time.time() - t0:.0f} s", flush=True)


def with_pads(variants: list[str], pads: list[int]) -> list[str]:
    """NAME=JSON -> NAME@P=JSON with -DAMK_LAYOUT_PAD=P added to its nvcc flags, for each pad P (in order)."""
    out = []
    for v in variants:
        name, _, js = v.partition("=")
        cfg = json.loads(js or "{}")
        for p in pads:
            c = dict(cfg)
            if p:
                c["nvcc"] = (c.get("nvcc", "") + f" -DAMK_LAYOUT_PAD={p}").strip()
            out.append(f"{name}@{p}={json.dumps(c)}")
    return out


def layout_means(rows: dict) -> list[tuple[str, float, float, float, int]]:
    """(variant, mean of its layouts' medians, min, max, layouts) per NAME of NAME@P rows that were timed."""
    groups: dict[str, list[float]] = {}
    for name, r in rows.items():
        if "median_us" in r:
            groups.setdefault(name.rsplit("@", 1)[0], []).append(r["median_us"])
    return [(n, statistics.mean(m), min(m), max(m), len(m)) for n, m in groups.items()]


def main():
    ap = variant_parser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=1, help="build the variants' extensions in this many processes first")
    ap.add_argument("--pads", default="", help="comma-separated AMK_LAYOUT_PAD values: time each variant in each layout")
    a = ap.parse_args()
    if a.pads:
        try:
            pads = [int(x) for x in a.pads.split(",")]
        except ValueError:
            ap.error(f"--pads {a.pads!r}: expected comma-separated integers >= 0, e.g. 0,4,8,16")
        if any(p < 0 for p in pads) or len(set(pads)) != len(pads):
            ap.error(f"--pads {a.pads!r}: pads must be distinct integers >= 0")
        a.variants = with_pads(a.variants, pads)
    if a.jobs > 1:
        prebuild(a)
    target = get_target("auto")
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    vms, rows = {}, {}
    for v in a.variants:
        name, cfg, build = parse_variant(v)
        set_build_env(build)
        row = rows[name] = {"variant": name, "config": cfg, "build": build}
        try:
            prog = lower(g, target, cfg, max_seq=bench_max_seq(a.ctx))
            res = validate(prog)
            if not res.ok:
                raise ValueError(res.errors[0])
            t0 = time.time()
            vm = MegakernelVM(prog, g.weights)
            chk = check_program(vm, g, 4)
            row.update(correct=chk["correct"], max_rel_err=chk["max_rel_err"], top1_agreement=chk["top1_agreement"],
                       checked_steps=chk["steps"], top1_miss=describe_misses(chk), build_s=round(time.time() - t0, 1),
                       floor_us=round(roofline(prog, ctx=a.ctx)["floor_us"], 1), rounds=[],
                       ring_bytes=vm.ring_bytes, ring_stages=vm.ring_stages,
                       ring_stages_requested=vm.ring_stages_requested, n_streamed=vm.n_streamed,
                       smem_bytes=vm.smem_bytes)
            if chk["correct"] or name.startswith("diag:"):
                vms[name] = vm
        except Exception as e:  # report and go on with the next variant
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
    set_build_env({})
    for _ in range(a.rounds):
        for name, vm in vms.items():
            rows[name]["rounds"].append(round(time_vm(vm, g.config.vocab, a.ctx, a.iters, repeats=1, warmup=3)["us"], 1))
    first = None
    print(f"\n== {a.model} {a.dtype} ctx {a.ctx} on {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}, "
          f"{a.rounds} interleaved rounds of {a.iters} steps")
    print(f"{'variant':16s} {'median us':>10s} {'min':>8s} {'max':>8s} {'x first':>8s}  build")
    for name, r in rows.items():
        if "error" in r or not r.get("rounds"):
            if "error" in r:
                why = r["error"]
            else:
                miss = f"; {r['top1_miss']}" if r["top1_miss"] else ""
                why = f"not correct: not timed (max rel err {r['max_rel_err']:.3g} over {r['checked_steps']} steps{miss})"
            print(f"{name:16s} {'-':>10s}  {why}")
            continue
        med = statistics.median(r["rounds"])
        r["median_us"] = med
        diag = name.startswith("diag:")
        if diag:   # its `correct` stays what the check said; the number is a bound either way
            r["note"] = "diagnostic bound of a knowingly wrong build, not a latency"
        first = first or med
        print(f"{name:16s} {med:10.1f} {min(r['rounds']):8.1f} {max(r['rounds']):8.1f} {med / first:8.3f}  "
              f"{json.dumps(r['build'])} {json.dumps(r['config'])}{'  (bound, not a latency)' if diag else ''}")
    means = layout_means(rows) if a.pads else []
    if means:
        print(f"\nmean over the layouts (pads {a.pads}):")
        print(f"{'variant':16s} {'mean us':>10s} {'min':>8s} {'max':>8s} {'x first':>8s}")
        for n, m, lo, hi, k in means:
            print(f"{n:16s} {m:10.1f} {lo:8.1f} {hi:8.1f} {m / means[0][1]:8.3f}  ({k} layouts)")
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], f"ab_{a.model}_{a.ctx}.json").write_text(json.dumps(list(rows.values()), indent=1))


if __name__ == "__main__":
    main()
