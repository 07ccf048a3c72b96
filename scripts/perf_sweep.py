"""Device script: correctness-gated timing of many schedule variants of one model in one process (one build per
distinct build-knob pair, cached), plus the torch peers; prints a table last and writes JSON to $OUT.

    python scripts/perf_sweep.py llama-3.2-1b --ctx 512 --variants default,rows32,... [--peers]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.bench import bench_max_seq, measure_program  # noqa: E402
from eval.roofline import roofline  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target, validate  # noqa: E402
from schedule.lower import lower  # noqa: E402

VARIANTS = {
    "default": {},
    "big_tiles": {"gemv_rows": 32, "mlp_rows": 64, "lm_head_rows": 128},
    "small_tiles": {"gemv_rows": 8, "mlp_rows": 16, "lm_head_rows": 32},
    "lpt": {"sm_assignment": "lpt"},
    "rr": {"sm_assignment": "round_robin"},
    "pf0": {"prefetch_depth": 0},
    "pf1": {"prefetch_depth": 1},
    "pf4": {"prefetch_depth": 4},
    "t256": {"threads_per_block": 256},
    "t1024": {"threads_per_block": 1024},
    "split2": {"attn_splits": 2},
    "split4": {"attn_splits": 4},
    "qkv2": {"qkv_heads": 2},
    "unfused": {"fuse_norm": False, "fuse_residual": False},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--extra", default="{}", help="JSON dict merged into every variant")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    a = ap.parse_args()
    t0 = time.time()
    target = get_target("auto")
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    extra = json.loads(a.extra)
    rows = []
    for name in a.variants.split(";"):
        cfg = {**VARIANTS[name], **extra} if name in VARIANTS else {**json.loads(name), **extra}
        prog = lower(g, target, cfg, max_seq=bench_max_seq(a.ctx))
        res = validate(prog)
        if not res.ok:
            rows.append({"variant": name, "error": res.errors[0]})
            continue
        t1 = time.time()
        try:
            m = measure_program(prog, g, ctx=a.ctx, iters=a.iters)
        except Exception as e:
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(name, "ERROR", e, flush=True)
            continue
        m.update({"variant": name, "tasks": len(prog.tasks), "config": cfg, "seconds": round(time.time() - t1, 1)})
        rows.append(m)
        print(json.dumps({k: m[k] for k in ("variant", "latency_us", "pct_of_roofline", "max_rel_err",
                                               "top1_agreement", "tasks", "seconds")}), flush=True)
    peers = {}
    if a.peers:
        from eval.baselines import hbm_bandwidth, torch_baselines
        peers = torch_baselines(g, a.ctx, bench_max_seq(a.ctx), None if a.compile_mode == "none" else a.compile_mode)
        peers.pop("logits_check", None)
        peers["bandwidth"] = hbm_bandwidth()
    rl = roofline(lower(g, target, {}, max_seq=bench_max_seq(a.ctx)), ctx=a.ctx)
    out = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": a.model, "ctx": a.ctx,
           "dtype": a.dtype, "floor_us": rl["floor_us"], "rows": rows, "peers": peers,
           "wall_s": round(time.time() - t0, 1)}
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], f"sweep_{a.model}_{a.ctx}.json").write_text(json.dumps(out, indent=1,
                                                                                              default=str))
    print(f"\n== {a.model} {a.dtype} ctx {a.ctx} on {out['gpu']} {out['date']}; floor {rl['floor_us']:.1f} us "
          f"(bytes / {rl['bandwidth_gbps']:.0f} GB/s)")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:14s} ERROR {r['error'][:100]}")
        else:
            lat = "-" if r["latency_us"] is None else f"{r['latency_us']:8.1f}"
            print(f"{r['variant']:14s} {lat} us  {r['pct_of_roofline'] or 0:5.1f}%  err {r['max_rel_err']:.1e} "
                  f"top1 {r['top1_agreement']:.2f}  tasks {r['tasks']}  {r['note'][:60]}")
    for k, v in peers.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
