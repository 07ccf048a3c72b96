"""How well does the cost model rank schedules? Spearman rank correlation of ``predict_us`` vs measured latency.

    # on a GPU machine: evaluate N configs (defaults + random samples), write them, print rho
    python scripts/cost_model_rank.py --measure 24 --model llama-3.2-1b --gpu h100 --out runs/measured.jsonl
    # anywhere: rank an existing JSONL of {"config", "latency_us"|"measured_us", ["predicted_us"], ["model", "gpu"]}
    python scripts/cost_model_rank.py --input runs/measured.jsonl [--model M --gpu G] [--json]

Only correct, measured points count (``latency_kind == "measured-gpu"`` when the record says). A record without
``predicted_us`` is lowered again to get it. Spearman is computed here (average ranks for ties; no scipy needed).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks; tied values share the average of their positions."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def pearson(a: list[float], b: list[float]) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho = Pearson correlation of the ranks (NaN with < 2 points or a constant side)."""
    if len(a) != len(b):
        raise ValueError(f"spearman: lengths differ ({len(a)} vs {len(b)})")
    if len(a) < 2:
        return float("nan")
    return pearson(ranks(a), ranks(b))


def measure(n: int, model: str, gpu: str, out: str, seed: int, ctx: int, device: str) -> list[dict]:
    import harness
    from flywheel import prior
    from schedule.ir import get_target
    if device != "cpu" and not harness._has_gpu():
        raise SystemExit("cost_model_rank: --measure needs a CUDA GPU (or --device cpu for a dry run)")
    rng, target = random.Random(seed), get_target(gpu)
    configs = [prior.defaults()] + [prior.random_config(rng, target) for _ in range(max(0, n - 1))]
    recs = []
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for i, cfg in enumerate(configs):
            v = harness.evaluate(model, gpu, cfg, device=device, ctx=ctx, seed=seed)
            rec = {"model": model, "gpu": v["gpu"], "config": v["config"], "latency_us": v["latency_us"],
                   "latency_kind": v["latency_kind"], "predicted_us": v["predicted_us"], "status": v["status"],
                   "schedule_id": v["schedule_id"]}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            recs.append(rec)
            print(f"[{i + 1}/{len(configs)}] {v['status']} {v['schedule_id']} measured {v['latency_us']} "
                  f"predicted {v['predicted_us']}", file=sys.stderr)
    return recs


def _predict(rec: dict, model: str | None, gpu: str | None, ctx: int) -> float | None:
    import harness
    from schedule.cost_model import predict_us
    from schedule.lower import lower
    m, g = rec.get("model") or model, rec.get("gpu") or gpu
    if not m or not g:
        raise SystemExit("cost_model_rank: a record has no predicted_us and no model/gpu (pass --model/--gpu)")
    target = harness._target(g)
    prog = lower(harness._graph(m, harness._default_dtype(m), 0), target, rec["config"])
    return predict_us(prog, target, ctx=ctx)


def rank_records(recs: list[dict], model: str | None = None, gpu: str | None = None, ctx: int = 512) -> dict:
    pts = []
    for r in recs:
        lat = r.get("latency_us", r.get("measured_us"))
        if lat is None or r.get("latency_kind", "measured-gpu") != "measured-gpu":
            continue
        pred = r.get("predicted_us")
        pred = pred if pred is not None else _predict(r, model, gpu, ctx)
        pts.append((float(pred), float(lat)))
    rho = spearman([p for p, _ in pts], [m for _, m in pts])
    return {"n": len(pts), "spearman": rho, "skipped": len(recs) - len(pts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", help="JSONL of measured points")
    ap.add_argument("--measure", type=int, default=0, help="evaluate N configs on the GPU first")
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--out", default="runs/measured.jsonl", help="where --measure appends its points")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.measure:
        if not a.model or not a.gpu:
            ap.error("--measure needs --model and --gpu")
        recs = measure(a.measure, a.model, a.gpu, a.out, a.seed, a.ctx, a.device)
        if a.device == "cpu":   # dry run: "measured" is the prediction itself
            recs = [{**r, "latency_kind": "measured-gpu"} for r in recs]
    elif a.input:
        recs = [json.loads(line) for line in pathlib.Path(a.input).read_text().splitlines() if line.strip()]
    else:
        ap.error("give --input FILE or --measure N")
    res = rank_records(recs, a.model, a.gpu, a.ctx)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"spearman rho(predict_us, measured) = {res['spearman']:.3f} over {res['n']} points "
              f"({res['skipped']} skipped: incorrect or not measured)")
    return 0 if res["n"] >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
