"""Device script (issue 4): where one decode step's time goes, per op family, from per-task timestamps.

    python scripts/trace_breakdown.py llama-3.2-1b --ctx 512 --variants 'reg={}' 'ring={"tma":1}'

A variant is NAME=JSON: schedule-config keys plus the build keys ``tma`` (0/1), ``stages``, ``stage_bytes`` and
``ring_window`` (the sm_90 weight ring), ``attn_stages`` and ``attn_stage_bytes`` (attention KV tiles) and ``nvcc`` (extra nvcc flags, e.g. "-DAMK_U2=8"). For each variant: correctness vs transformers (eval.bench.check_program), the timed latency
(CUDA events, median), then one traced step (MegakernelVM.trace_step) broken down into (``--marks``: also the
segments inside each task, from a build with -DAMK_MARKS=1)
  * per family (QKV, attention, o_proj, gate_up, down, lm_head ...): tasks, mean wait, mean execution, and the
    streaming rate of one task while it executes (est_bytes / execution time);
  * per SM: busy (executing), waiting on counters, and the rest (instruction fetch, gaps);
  * one middle layer's phase windows (first start .. last end of each family), to see the phase boundaries.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from eval.roofline import roofline  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target, validate  # noqa: E402
from schedule.lower import lower  # noqa: E402

BUILD_KEYS = {"tma": "AMK_TMA", "stages": "AMK_STAGES", "stage_bytes": "AMK_STAGE_BYTES", "nvcc": "AMK_NVCC_FLAGS",
              "ring_window": "AMK_RING_WINDOW",
              "attn_stages": "AMK_ATTN_STAGES", "attn_stage_bytes": "AMK_ATTN_STAGE_BYTES"}


def family(label: str) -> tuple[str, int]:
    """'L3.gate_up[0:64]' -> ('gate_up', 3); 'lm_head[0:128]' -> ('lm_head', -1); a multi-step launch's later
    steps ('s2.L3.gate_up[0:64]') count as their step-0 twins."""
    label = re.sub(r"^s\d+\.", "", label)
    m = re.match(r"L(\d+)\.([a-z_]+)", label)
    if m:
        return m.group(2), int(m.group(1))
    return re.match(r"[a-z_]*", label).group(0) or "?", -1


def breakdown(prog, tr) -> dict:
    t0, t1, t2, sm = tr["t0"] / 1e3, tr["t1"] / 1e3, tr["t2"] / 1e3, tr["sm"]   # us
    span = float(t2.max() - t0.min())
    index = {t.id: i for i, t in enumerate(prog.tasks)}
    prev_same = np.zeros(len(prog.tasks), dtype=bool)   # the task before it on its SM is of the same family
    for q in prog.queues:
        for a, b in zip(q, q[1:]):
            prev_same[index[b]] = family(prog.tasks[index[a]].label)[0] == family(prog.tasks[index[b]].label)[0]
    fams: dict[str, dict] = {}
    for i, t in enumerate(prog.tasks):
        f, _ = family(t.label)
        d = fams.setdefault(f, {"n": 0, "wait": 0.0, "exec": 0.0, "bytes": 0, "n_warm": 0, "exec_warm": 0.0})
        d["n"] += 1
        d["wait"] += float(t1[i] - t0[i])
        d["exec"] += float(t2[i] - t1[i])
        d["bytes"] += int(t.est_bytes)
        if prev_same[i]:
            d["n_warm"] += 1
            d["exec_warm"] += float(t2[i] - t1[i])
    # segments inside a task from the trace marks (vm/csrc/amk_launch.h): ready -> op entry -> input staged ->
    # main loop done -> closing barrier -> signalled. A segment is averaged over the tasks that set both ends.
    mk = tr["marks"] / 1e3
    pts = np.column_stack([t1, mk[:, 0], mk[:, 1], mk[:, 2], mk[:, 3], t2])
    valid = np.column_stack([np.ones(len(t1), bool), tr["marks"] >= 0, np.ones(len(t1), bool)])
    seg_names = ["to_entry", "stage", "main", "to_barrier", "signal"]
    segs: dict[str, list] = {}
    for i, t in enumerate(prog.tasks):
        f, _ = family(t.label)
        acc = segs.setdefault(f, [[0.0, 0] for _ in seg_names])
        idx = [k for k in range(6) if valid[i, k]]
        for a, b in zip(idx, idx[1:]):       # a skipped mark folds its segment into the next one
            acc[b - 1][0] += float(pts[i, b] - pts[i, a])
            acc[b - 1][1] += 1
    rows = []
    for f, d in fams.items():
        n_cold = d["n"] - d["n_warm"]
        rows.append({"family": f, "tasks": d["n"], "wait_us": round(d["wait"] / d["n"], 2),
                     "exec_us": round(d["exec"] / d["n"], 2), "exec_total_us": round(d["exec"], 1),
                     "gbps_per_task": round(d["bytes"] / max(d["exec"], 1e-9) / 1e3, 1),
                     # exec of tasks that follow a task of the same family on their SM (op code already hot) vs
                     # the others: the difference is the cost of a cold start (instruction fetch, first loads)
                     "exec_after_same_us": round(d["exec_warm"] / d["n_warm"], 2) if d["n_warm"] else None,
                     "exec_after_other_us": round((d["exec"] - d["exec_warm"]) / n_cold, 2) if n_cold else None,
                     "segments_us": {nm: (round(v / n, 2) if n else None)
                                     for nm, (v, n) in zip(seg_names, segs[f])}})
    n_sm = int(sm.max()) + 1
    busy = np.zeros(n_sm)
    wait = np.zeros(n_sm)
    for i in range(len(prog.tasks)):
        busy[sm[i]] += t2[i] - t1[i]
        wait[sm[i]] += t1[i] - t0[i]
    per_sm = {"span_us": round(span, 1), "busy_mean_us": round(float(busy.mean()), 1),
              "busy_min_us": round(float(busy.min()), 1), "busy_max_us": round(float(busy.max()), 1),
              "wait_mean_us": round(float(wait.mean()), 1),
              "other_mean_us": round(float(span - busy.mean() - wait.mean()), 1)}
    layers = sorted({family(t.label)[1] for t in prog.tasks} - {-1})
    mid = layers[len(layers) // 2] if layers else -1
    win: dict[str, list[float]] = {}
    for i, t in enumerate(prog.tasks):
        f, L = family(t.label)
        if L == mid:
            w = win.setdefault(f, [1e18, -1e18])
            w[0], w[1] = min(w[0], float(t1[i])), max(w[1], float(t2[i]))
    base = min((w[0] for w in win.values()), default=0.0)
    phases = {f: [round(w[0] - base, 1), round(w[1] - base, 1)] for f, w in sorted(win.items(), key=lambda x: x[1])}
    return {"families": rows, "per_sm": per_sm, "layer": mid, "phases": phases}


def parse_variant(v: str, marks: bool = False) -> tuple[str, dict, dict]:
    """'NAME=JSON' -> (name, schedule config, build keys); marks adds -DAMK_MARKS=1 to the nvcc flags."""
    name, _, js = v.partition("=")
    cfg = json.loads(js or "{}")
    build = {k: cfg.pop(k) for k in list(cfg) if k in BUILD_KEYS}
    if marks:
        build["nvcc"] = (build.get("nvcc", "") + " -DAMK_MARKS=1").strip()
    return name, cfg, build


def set_build_env(build: dict) -> None:
    """Point vm/jit.py's spec_for at this variant's build (read when a MegakernelVM is constructed)."""
    for k, env in BUILD_KEYS.items():
        os.environ.pop(env, None)
        if k in build:
            os.environ[env] = str(build[k]) if k == "nvcc" else str(int(build[k]))


def variant_parser(doc: str | None = None) -> argparse.ArgumentParser:
    """The arguments every variant script takes: model, --ctx, --dtype, --iters, --variants NAME=JSON ..."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=["default={}"])
    return ap


def main():
    ap = variant_parser()
    ap.add_argument("--marks", action="store_true",
                    help="build with -DAMK_MARKS=1: per-task segments (op entry, input staged, main loop, barrier); "
                         "the marks themselves add ~2%% to the measured latency")
    a = ap.parse_args()
    from vm.loader import MegakernelVM
    target = get_target("auto")
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    out = []
    for v in a.variants:
        name, cfg, build = parse_variant(v, a.marks)
        set_build_env(build)
        try:
            prog = lower(g, target, cfg, max_seq=bench_max_seq(a.ctx))
        except Exception as e:  # a config the IR refuses: report and go on
            out.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        res = validate(prog)
        if not res.ok:
            out.append({"variant": name, "error": res.errors[0]})
            continue
        t_s = time.time()
        try:
            vm = MegakernelVM(prog, g.weights)
            chk = check_program(vm, g, 4)
            lat = time_vm(vm, g.config.vocab, a.ctx, a.iters, 5)["us"] if chk["correct"] else None
            vm.reset()
            for p in range(4):
                vm.step(p + 1, p)
            bd = breakdown(prog, vm.trace_step(7, a.ctx))
        except Exception as e:  # report and go on with the next variant
            out.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(name, "ERROR", e, flush=True)
            continue
        floor = roofline(prog, ctx=a.ctx)["floor_us"]
        row = {"variant": name, "config": cfg, "build": build, "ring_bytes": vm.ring_bytes,
               "ring_stages": vm.ring_stages, "streamed": vm.n_streamed, "preload_bytes": vm.preload_bytes,
               "preloaded": vm.n_preloaded,
               "correct": chk["correct"], "max_rel_err": chk["max_rel_err"],
               "latency_us": None if lat is None else round(lat, 1), "floor_us": round(floor, 1),
               "seconds": round(time.time() - t_s, 1), **bd}
        out.append(row)
        print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], f"trace_{a.model}_{a.ctx}.json").write_text(json.dumps(out, indent=1))
    print(f"\n== {a.model} {a.dtype} ctx {a.ctx} on {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}")
    for r in out:
        if "error" in r:
            print(f"{r['variant']}: ERROR {r['error'][:200]}")
            continue
        s = r["per_sm"]
        print(f"{r['variant']}: {r['latency_us']} us (floor {r['floor_us']}), correct {r['correct']}, ring "
              f"{r['ring_bytes']} B, {r['streamed']} streamed tasks, preload {r['preload_bytes']} B for {r['preloaded']} "
              f"tasks; traced span {s['span_us']} us; per SM busy "
              f"{s['busy_mean_us']} (min {s['busy_min_us']}, max {s['busy_max_us']}), waiting {s['wait_mean_us']}, "
              f"other {s['other_mean_us']}")
        print(f"  {'family':12s} {'tasks':>6s} {'wait us':>8s} {'exec us':>8s} {'exec tot':>9s} {'GB/s/task':>9s} "
              f"{'after same':>10s} {'after other':>11s}")
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        for f in r["families"]:
            print(f"  {f['family']:12s} {f['tasks']:6d} {f['wait_us']:8.2f} {f['exec_us']:8.2f} "
                  f"{f['exec_total_us']:9.1f} {f['gbps_per_task']:9.1f} {fmt(f['exec_after_same_us']):>10s} "
                  f"{fmt(f['exec_after_other_us']):>11s}")
        if not a.marks:
            print(f"  layer {r['layer']} phases (us from its first task start): " +
                  ", ".join(f"{k} {w[0]}-{w[1]}" for k, w in r["phases"].items()))
            continue
        print(f"  {'family':12s} " + " ".join(f"{k:>10s}" for k in r["families"][0]["segments_us"]) +
              "   (us inside a task: ready -> op entry -> input staged -> main loop -> barrier -> signalled)")
        for f in r["families"]:
            print(f"  {f['family']:12s} " + " ".join(f"{fmt(v):>10s}" for v in f["segments_us"].values()))
        print(f"  layer {r['layer']} phases (us from its first task start): " +
              ", ".join(f"{k} {w[0]}-{w[1]}" for k, w in r["phases"].items()))


if __name__ == "__main__":
    main()
