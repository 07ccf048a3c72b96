"""Validator vs oracle on adversarial schedules (issue 7).

Runs N schedules from ``schedule.adversarial.generate`` (mutants of lowered toy programs + random small DAGs, some
unmutated), judges each with ``schedule.validate.validate`` and the independent ``schedule.oracle.check``, and
prints per mutation kind: how many the validator rejected, how many the oracle found bad (deadlock / race / uninit /
malformed ...), **false accepts** (validator OK, oracle finds a problem: a soundness bug) and **false rejects**
(validator rejects, oracle finds nothing: the contract is stricter than the dynamic behaviour, e.g. an under-counted
wait that happens to be covered by queue order), with the validator's error kinds for the false rejects.

    python scripts/adversarial_report.py                  # 10,000 schedules, seed 0, 2 worker processes
    python scripts/adversarial_report.py -n 2000 --seed 3 --out-dir runs/adversarial --json summary.json

Each false case is saved as JSON (program, description, validator report, oracle findings) under --out-dir.
Work is split into fixed chunks seeded by (seed, chunk), so results do not depend on the number of workers.
Exit status 1 if there is any false accept.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections import Counter, defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

CHUNK = 250
_BASES = None


def _init(toy_share: float) -> None:
    global _BASES
    if toy_share > 0:
        from schedule.adversarial import toy_bases
        _BASES = toy_bases()


def run_chunk(args: tuple) -> dict:
    """Judge one chunk; returns counts and the false cases (with programs as dicts)."""
    from schedule.adversarial import generate
    from schedule.oracle import check
    from schedule.validate import validate
    seed, chunk, n, toy_share = args
    rows: list[tuple] = []
    false_cases: list[dict] = []
    t_val = t_orc = 0.0
    gen = generate(seed * 1_000_003 + chunk, n, toy_share=toy_share if _BASES else 0.0, bases=_BASES)
    for k, (base, kind, desc, prog) in enumerate(gen):
        t0 = time.perf_counter()
        v = validate(prog)
        t1 = time.perf_counter()
        o = check(prog, seed=k)
        t2 = time.perf_counter()
        t_val, t_orc = t_val + t1 - t0, t_orc + t2 - t1
        fam = base.rstrip("0123456789")
        kinds = tuple(sorted(v.stats.get("error_kinds", {}))) if not v.ok else ()
        rows.append((fam, kind.split("+")[0], v.ok, o.ok, kinds, tuple(o.categories)))
        if v.ok != (o.ok):
            false_cases.append({"type": "false_accept" if v.ok else "false_reject", "seed": seed, "chunk": chunk,
                                "index": k, "base": base, "mutation": kind, "description": desc,
                                "validator": v.report(), "validator_error_kinds": list(kinds),
                                "oracle": o.findings, "oracle_runs": o.runs, "program": prog.to_dict()})
    return {"rows": rows, "false": false_cases, "t_val": t_val, "t_orc": t_orc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--num", type=int, default=10_000, help="schedules to run (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes (default 2; 1 = in-process)")
    ap.add_argument("--toy-share", type=float, default=0.25, help="fraction that mutates lowered toy programs")
    ap.add_argument("--out-dir", type=pathlib.Path, default=None, help="save every false case here as JSON")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the summary table as JSON")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    jobs = [(a.seed, c, min(CHUNK, a.num - c * CHUNK), a.toy_share) for c in range((a.num + CHUNK - 1) // CHUNK)]
    if a.workers <= 1:
        _init(a.toy_share)
        results = [run_chunk(j) for j in jobs]
    else:
        import multiprocessing as mp
        with mp.get_context("spawn" if sys.platform == "darwin" else "fork").Pool(
                a.workers, initializer=_init, initargs=(a.toy_share,)) as pool:
            results = pool.map(run_chunk, jobs, chunksize=1)
    summary = summarize(results)
    summary.update(seconds=round(time.perf_counter() - t0, 1), workers=a.workers, seed=a.seed)
    print(render(summary))
    if a.out_dir is not None:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        for r in results:
            for case in r["false"]:
                name = f"{case['type']}_s{case['seed']}_c{case['chunk']}_{case['index']}.json"
                (a.out_dir / name).write_text(json.dumps(case, indent=1))
        print(f"saved {summary['false_accepts'] + summary['false_rejects']} false case(s) under {a.out_dir}")
    if a.json is not None:
        a.json.write_text(json.dumps(summary, indent=1))
    return 1 if summary["false_accepts"] else 0


def summarize(results: list[dict]) -> dict:
    table: dict[str, Counter] = defaultdict(Counter)
    fr_reasons: Counter = Counter()
    oracle_cats: Counter = Counter()
    for r in results:
        for fam, kind, vok, ook, kinds, cats in r["rows"]:
            for key in (f"{fam}:{kind}", "TOTAL"):
                c = table[key]
                c["schedules"] += 1
                c["val_reject"] += not vok
                c["oracle_bad"] += not ook
                c["false_accept"] += vok and not ook
                c["false_reject"] += (not vok) and ook
            oracle_cats.update(cats)
            if not vok and ook:
                fr_reasons[", ".join(kinds)] += 1
    tot = table["TOTAL"]
    return {"schedules": tot["schedules"], "false_accepts": tot["false_accept"], "false_rejects": tot["false_reject"],
            "table": {k: dict(v) for k, v in sorted(table.items(), key=lambda kv: (kv[0] == "TOTAL", kv[0]))},
            "false_reject_reasons": dict(fr_reasons.most_common()), "oracle_categories": dict(oracle_cats),
            "validate_s": round(sum(r["t_val"] for r in results), 2),
            "oracle_s": round(sum(r["t_orc"] for r in results), 2)}


def render(s: dict) -> str:
    cols = ("schedules", "val_reject", "oracle_bad", "false_accept", "false_reject")
    w = max(len(k) for k in s["table"]) + 2
    lines = [f"{'base:mutation':<{w}}" + "".join(f"{c:>14}" for c in cols)]
    for k, c in s["table"].items():
        if k == "TOTAL":
            lines.append("-" * (w + 14 * len(cols)))
        lines.append(f"{k:<{w}}" + "".join(f"{c.get(col, 0):>14}" for col in cols))
    lines.append("")
    lines.append(f"{s['schedules']} schedules in {s['seconds']} s ({s['workers']} worker(s); validate "
                 f"{s['validate_s']} s, oracle {s['oracle_s']} s of CPU): false accepts {s['false_accepts']}, "
                 f"false rejects {s['false_rejects']}")
    if s["false_reject_reasons"]:
        lines.append("false rejects by validator error kinds (contract stricter than any execution):")
        lines += [f"  {n:>6}  {k}" for k, n in s["false_reject_reasons"].items()]
    lines.append("oracle findings: " + ", ".join(f"{k}={v}" for k, v in sorted(s["oracle_categories"].items())))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
