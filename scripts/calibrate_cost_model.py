"""The cost model against the current kernel's measurements: per-record error, A/B ordering, a layer's phases, a fit.

    python scripts/calibrate_cost_model.py                      # report CALIB on docs/measured_ab_h100.jsonl
    python scripts/calibrate_cost_model.py --fit --rounds 2     # coordinate descent over the free constants
    python scripts/calibrate_cost_model.py --set l2_us=0.9 sm_gbps=36   # report with some constants changed

Records (``docs/measured_ab_h100.jsonl``): {group, model, gpu, ctx, config (overrides on the current defaults),
latency_us, latency_kind, source}. A group is one interleaved A/B table of docs/PERF.md (one process, one machine),
or one bench (its own machine). The loss has two parts, both in log space:
* within a group, each variant's predicted ratio to the group's first record against the measured ratio
  (machines differ by up to ~1-10% in absolute terms; a ratio from one process is what an A/B measures);
* across groups, the first record's absolute error (weighted by ``--abs-weight``).
The layer phases of llama-3.2-1b at ctx 512 are printed next to the tenth session's trace (not in the loss).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from schedule.cost_model import CALIB, Calib, Prepared, simulate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "measured_ab_h100.jsonl"
# llama-3.2-1b ctx 512, layer 8, us from its first task (docs/PERF.md tenth session, after the context fix)
TRACED_PHASES = {"q": (0.0, 7.9), "attn": (8.1, 15.6), "attn_merge": (16.9, 19.5), "o_proj": (19.7, 26.1),
                 "gate_up": (26.4, 50.7), "down": (51.0, 65.3)}
FREE = ("sm_gbps", "notice_us", "l2_us", "l2_load_us", "hbm_us", "stage_gbps", "l2_gbps", "tail_us", "tail_frac",
        "qkv_epilogue_us", "qknorm_epilogue_us", "attn_pos_us", "attn_tail_us", "merge_us", "fused_merge_gbps",
        "launch_us", "bw_eff")


def load_records(path: pathlib.Path = RECORDS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prepare_all(recs: list[dict]) -> dict[str, Prepared]:
    """One lowered + prepared program per distinct (model, gpu, ctx, config); lowered as the bench lowers
    (eval.bench.bench_max_seq; bf16 preset weights never materialised)."""
    import harness
    from eval.bench import bench_max_seq
    from flywheel.prior import defaults
    from schedule.lower import lower
    out: dict[str, Prepared] = {}
    for r in recs:
        key = record_key(r)
        if key not in out:
            cfg = {**defaults(), **r["config"]}
            graph = harness._graph(r["model"], "bf16", 0)
            prog = lower(graph, harness._target(r["gpu"]), cfg, max_seq=bench_max_seq(int(r["ctx"])))
            out[key] = Prepared(prog, int(r["ctx"]))
    return out


def record_key(r: dict) -> str:
    return json.dumps([r["model"], r["gpu"], r["ctx"], r["config"]], sort_keys=True)


def predict_all(recs: list[dict], progs: dict[str, Prepared], calib: Calib) -> list[float]:
    cache: dict[str, float] = {}
    for r in recs:
        k = record_key(r)
        if k not in cache:
            cache[k] = simulate(progs[k], calib=calib).step_us
    return [cache[record_key(r)] for r in recs]


def loss(recs: list[dict], pred: list[float], abs_weight: float = 0.5) -> dict:
    """{'rel': mean |log ratio error| within groups, 'abs': mean |log error| of each group's first record,
    'total', 'pairs_ok' / 'pairs': A/B pairs measured > 1.5% apart that the model orders the same way}."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(recs):
        groups.setdefault(r["group"], []).append(i)
    rel, ab, ok, n = [], [], 0, 0
    for idx in groups.values():
        b = idx[0]
        ab.append(abs(math.log(pred[b] / recs[b]["latency_us"])))
        for i in idx[1:]:
            rel.append(abs(math.log(pred[i] / pred[b]) - math.log(recs[i]["latency_us"] / recs[b]["latency_us"])))
        for x in idx:
            for y in idx:
                mx, my = recs[x]["latency_us"], recs[y]["latency_us"]
                if x < y and abs(math.log(mx / my)) > math.log(1.015):
                    n += 1
                    ok += (mx < my) == (pred[x] < pred[y])
    r_, a_ = (sum(rel) / len(rel) if rel else 0.0), sum(ab) / len(ab)
    return {"rel": r_, "abs": a_, "total": r_ + abs_weight * a_, "pairs_ok": ok, "pairs": n}


def layer_phases(pre: Prepared, calib: Calib) -> dict[str, tuple[float, float]]:
    """A middle layer's family windows (first op entry .. last counter release), us from its first task."""
    res = simulate(pre, calib=calib)
    tasks = pre.program.tasks
    layers = sorted({int(m.group(1)) for t in tasks if (m := re.match(r"L(\d+)\.", t.label))})
    mid = layers[len(layers) // 2]
    win: dict[str, list[float]] = {}
    for i, t in enumerate(tasks):
        m = re.match(r"L(\d+)\.([a-z_]+)", t.label)
        if m and int(m.group(1)) == mid:
            w = win.setdefault(m.group(2), [1e18, -1e18])
            w[0], w[1] = min(w[0], res.ready[i]), max(w[1], res.end[i])
    base = min(w[0] for w in win.values())
    return {f: (round(w[0] - base, 1), round(w[1] - base, 1)) for f, w in sorted(win.items(), key=lambda x: x[1])}


_WORK: tuple = ()   # (recs, progs, abs_weight) for the fit's worker processes (inherited through fork)


def _loss_of(calib: Calib) -> float:
    recs, progs, abs_weight = _WORK
    return loss(recs, predict_all(recs, progs, calib), abs_weight)["total"]


def fit(recs, progs, calib: Calib, rounds: int, abs_weight: float, free=FREE, jobs: int = 2) -> Calib:
    """Coordinate descent: round r tries each free constant at x(1 -+ 0.3 / 2^r) (bw_eff: -+ 2% / 2^r) and keeps the
    best when the total loss drops. Candidates are simulated in ``jobs`` processes."""
    import multiprocessing as mp
    global _WORK
    _WORK = (recs, progs, abs_weight)
    best = _loss_of(calib)
    with mp.get_context("fork").Pool(jobs) as pool:
        for rnd in range(rounds):
            d = 0.3 / 2 ** rnd
            for name in free:
                v0 = getattr(calib, name)
                fs = (1 - d / 15, 1 + d / 15) if name == "bw_eff" else (1 - d, 1 + d)
                cands = [calib.scaled(**{name: round(min(v0 * f, 1.0) if name == "bw_eff" else v0 * f, 4)})
                         for f in fs]
                for cand, lv in zip(cands, pool.map(_loss_of, cands)):
                    if lv < best - 1e-5:
                        best, calib = lv, cand
                print(f"round {rnd + 1} {name} = {getattr(calib, name)}  loss {best:.4f}", file=sys.stderr,
                      flush=True)
    return calib


def report(recs, progs, calib: Calib, abs_weight: float) -> dict:
    pred = predict_all(recs, progs, calib)
    out = {"loss": loss(recs, pred, abs_weight), "records": []}
    for r, p in zip(recs, pred):
        out["records"].append({"group": r["group"], "config": r["config"], "measured_us": r["latency_us"],
                               "predicted_us": round(p, 1), "err_pct": round(100 * (p / r["latency_us"] - 1), 1)})
    key = next((k for k, v in progs.items() if v.program.meta["model"] == "llama-3.2-1b" and v.ctx == 512), None)
    if key:
        out["llama_1b_layer_phases"] = {"predicted": layer_phases(progs[key], calib), "traced": TRACED_PHASES}
    return out


SWEEP_RANGES = {"attn_splits": (1, 2, 4, 16), "num_sms": (66, 100), "threads_per_block": (256, 1024),
                "prefetch_depth": (1, 2)}
NOT_MODELLED = ("preload_kb", "ring_stages", "ring_stage_kb", "ring_window")   # shared-memory paths: not simulated


def sweep(model: str, gpu: str, ctx: int, calib: Calib) -> list[dict]:
    """Every single-knob change from the defaults, predicted (the cost model's view of where to look next)."""
    import harness
    from eval.bench import bench_max_seq
    from flywheel.prior import KNOBS, defaults
    from schedule.ir import IRError
    from schedule.lower import lower
    target, graph = harness._target(gpu), harness._graph(model, "bf16", 0)
    base = defaults()
    out = []
    for knob, value in [(None, None)] + [(k.name, v) for k in KNOBS if k.name not in NOT_MODELLED
                                         for v in (k.choices or SWEEP_RANGES.get(k.name, ())) if v != k.default]:
        cfg = dict(base) if knob is None else {**base, knob: value}
        try:
            prog = lower(graph, target, cfg, max_seq=bench_max_seq(ctx))
        except IRError as e:
            out.append({"knob": knob, "value": value, "error": str(e)[:80]})
            continue
        out.append({"knob": knob, "value": value, "predicted_us": round(simulate(prog, target, ctx, calib).step_us, 1)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(RECORDS))
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--abs-weight", type=float, default=0.5)
    ap.add_argument("--set", nargs="*", default=[], help="NAME=VALUE constants of Calib to change first")
    ap.add_argument("--holdout", nargs="*", default=[],
                    help="group-name prefixes left out of the fit (reported apart as held out)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sweep", metavar="MODEL", help="predict every single-knob change from the defaults instead")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--ctx", type=int, default=512)
    a = ap.parse_args(argv)
    calib = CALIB
    names = {f.name for f in dataclasses.fields(Calib)}
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in names:
            ap.error(f"--set: unknown constant {k!r} (known: {', '.join(sorted(names))})")
        calib = calib.scaled(**{k: type(getattr(calib, k))(float(v))})
    if a.sweep:
        rows = sweep(a.sweep, a.gpu, a.ctx, calib)
        base = rows[0]["predicted_us"]
        for r in sorted(rows, key=lambda r: r.get("predicted_us", 1e18)):
            what = "defaults" if r["knob"] is None else f"{r['knob']} = {r['value']}"
            if "error" in r:
                print(f"{what:36s} not lowered: {r['error']}")
            else:
                pct = 100 * (r["predicted_us"] / base - 1)
                print(f"{what:36s} {r['predicted_us']:9.1f} us predicted ({pct:+.1f}%)")
        return 0
    recs = load_records(pathlib.Path(a.input))
    progs = prepare_all(recs)
    held = [r for r in recs if r["group"].startswith(tuple(a.holdout))] if a.holdout else []
    if a.fit:
        calib = fit([r for r in recs if r not in held], progs, calib, a.rounds, a.abs_weight)
        changed = {f.name: getattr(calib, f.name) for f in dataclasses.fields(Calib)
                   if getattr(calib, f.name) != getattr(CALIB, f.name)}
        print("fitted: " + json.dumps(changed))
    rep = report(recs, progs, calib, a.abs_weight)
    if held:
        rep["held_out_loss"] = loss(held, predict_all(held, progs, calib), a.abs_weight)
        rep["fitted_loss"] = loss([r for r in recs if r not in held],
                                  predict_all([r for r in recs if r not in held], progs, calib), a.abs_weight)
    if a.json:
        print(json.dumps(rep, indent=1))
        return 0
    for r in rep["records"]:
        print(f"{r['group']:32s} {json.dumps(r['config'])[:60]:60s} meas {r['measured_us']:8.1f} "
              f"pred {r['predicted_us']:8.1f} ({r['err_pct']:+.1f}%)")
    lo = rep["loss"]
    print(f"loss: within-group {lo['rel']:.4f}, absolute {lo['abs']:.4f}, total {lo['total']:.4f}; "
          f"A/B pairs > 1.5% apart ordered right: {lo['pairs_ok']} / {lo['pairs']}")
    for k in ("fitted_loss", "held_out_loss"):
        if k in rep:
            lo = rep[k]
            print(f"{k}: within-group {lo['rel']:.4f}, absolute {lo['abs']:.4f}; pairs ordered right "
                  f"{lo['pairs_ok']} / {lo['pairs']}")
    if "llama_1b_layer_phases" in rep:
        ph = rep["llama_1b_layer_phases"]
        print("llama-3.2-1b ctx 512, middle layer (us): "
              + ", ".join(f"{f} {p[0]}-{p[1]}" for f, p in ph["predicted"].items()))
        print("  traced (tenth session, layer 8):        "
              + ", ".join(f"{f} {p[0]}-{p[1]}" for f, p in ph["traced"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
