"""Device script (issue 4): raw per-task timestamps of several decode steps, for analysis off the GPU.

    python scripts/trace_raw.py llama-3.2-1b --ctx 512 --steps 5 --variants 'base={}'

For each variant (trace_breakdown.py's NAME=JSON syntax): lower, check against transformers (a wrong program is
never traced; a variant named diag:NAME is a diagnostic build, traced without the gate and timed as a bound),
time (CUDA events), then trace ``--steps`` consecutive steps at position ctx (MegakernelVM.trace_step) and write
$OUT/raw_MODEL_CTX_NAME.npz: t0 / t1 / t2 [steps, tasks] (ns: reached, waits met, done), sm (queue), smid (physical SM), marks [steps, tasks,
4] (``--marks`` builds: op entry, input staged, main loop done, closing barrier; else -1), and the program's task
table (label, op, queue position, first wait counter, out counter, est_bytes, hbm_bytes) for
scripts/hop_anatomy.py, which takes the layers and their phase boundaries apart without the GPU.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target, validate  # noqa: E402
from schedule.lower import lower  # noqa: E402
from scripts.trace_breakdown import parse_variant, set_build_env, variant_parser  # noqa: E402


def task_table(prog, ctx: int) -> dict:
    """The program's tasks as flat arrays (index = position in prog.tasks); hbm_bytes: each task's weight / KV bytes
    at context ``ctx`` (schedule.cost_model.task_bytes: what it must stream from HBM, its input reads not counted)."""
    from schedule.cost_model import task_bytes
    index = {t.id: i for i, t in enumerate(prog.tasks)}
    qpos = np.full(len(prog.tasks), -1, dtype=np.int64)
    qsm = np.full(len(prog.tasks), -1, dtype=np.int64)
    for s, q in enumerate(prog.queues):
        for k, tid in enumerate(q):
            qpos[index[tid]], qsm[index[tid]] = k, s
    return {"label": np.array([t.label for t in prog.tasks]), "op": np.array([t.op for t in prog.tasks]),
            "queue_sm": qsm, "queue_pos": qpos, "out_counter": np.array([t.out_counter for t in prog.tasks]),
            "wait0": np.array([t.waits[0].counter if t.waits else -1 for t in prog.tasks]),
            "est_bytes": np.array([t.est_bytes for t in prog.tasks], dtype=np.int64),
            "hbm_bytes": np.array([task_bytes(prog, t, ctx) for t in prog.tasks], dtype=np.int64)}


def main():
    ap = variant_parser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--marks", action="store_true", help="build with -DAMK_MARKS=1 and keep the per-task marks")
    a = ap.parse_args()
    from vm.loader import MegakernelVM
    target = get_target("auto")
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    for v in a.variants:
        name, cfg, build = parse_variant(v, a.marks)
        set_build_env(build)
        prog = lower(g, target, cfg, max_seq=bench_max_seq(a.ctx))
        res = validate(prog)
        if not res.ok:
            print(name, "INVALID", res.errors[0])
            continue
        vm = MegakernelVM(prog, g.weights)
        chk = check_program(vm, g, 4)
        diag = name.startswith("diag:")   # a diagnostic build (wrong results by design): traced, never a latency
        if diag:
            vm.reset()
        elif not chk["correct"]:
            print(name, "WRONG", chk["max_rel_err"])
            continue
        lat = time_vm(vm, g.config.vocab, a.ctx, a.iters, 5)["us"]
        trs = []
        for s in range(a.steps):
            trs.append(vm.trace_step(7 + s, a.ctx))
        lat2 = time_vm(vm, g.config.vocab, a.ctx, a.iters, 3)["us"]
        arrs = {k: np.stack([tr[k] for tr in trs]) for k in ("t0", "t1", "t2", "sm", "smid", "marks")}
        np.savez_compressed(out_dir / f"raw_{a.model}_{a.ctx}_{name.replace(':', '-')}.npz", **arrs,
                            **task_table(prog, a.ctx))
        kind = "bound_us" if diag else "latency_us"
        print(json.dumps({"variant": name, kind: round(lat, 1), kind + "_after": round(lat2, 1),
                          "traced_spans_us": [round(float(t["t2"].max() - t["t0"].min()) / 1e3, 1) for t in trs],
                          "max_rel_err": chk["max_rel_err"], "ring_stages": vm.ring_stages}), flush=True)


if __name__ == "__main__":
    main()
