"""Which blocks stream slowest, step after step, and where they sit (no GPU needed).

    python scripts/queue_speed.py raw_llama-3.2-1b_512_base.npz [--gpcs gpcs.json] [--l2map l2_home_sm.bin]
                                  [--layers 2:14]

Input: scripts/trace_raw.py's records (t1 / t2 per task and step, the queue ``sm`` and, in traces taken since the
thirty-sixth session, the physical SM ``smid``) and optionally scripts/gpc_probe.cu's JSON (which SMs share a GPC).
For each streaming family (o_proj, gate_up, down and the QKV tiles) it prints:
  * one line per traced step: every queue's mean execution over the layers, '#' > 6%, '+' > 2.5% above the step's
    median queue, '.' otherwise, ' ' for queues that run no task of the family -- a column of '#' in every step is a
    block that is slow by where it is, not by chance;
  * the slow queues (> 6% in the mean over steps) and the physical SMs they ran on;
  * with --gpcs: per GPC, its size and its queues' mean execution relative to the median (was the slow set one GPC?);
  * with --l2map (scripts/l2_home_micro.cu's l2_home_sm.bin: the L2 partition of each SM id, int32, -1 unused): the
    same per L2 partition.
The tasks of a phase are equal tiles, so the phase ends on its slowest block (docs/PERF.md, thirty-sixth session).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scripts.hop_anatomy import families  # noqa: E402

FAMILIES = ("q", "o_proj", "gate_up", "down")
SLOW, SOME = 1.06, 1.025


def queue_exec(d, fam, lay, f: str, layers) -> np.ndarray:
    """[steps, queues]: each queue's mean execution (us) of family f's tasks in the given layers; NaN where none."""
    t1, t2, qs = d["t1"] / 1e3, d["t2"] / 1e3, d["queue_sm"]
    n_q = int(qs.max()) + 1
    m = (fam == f) & np.isin(lay, list(layers))
    out = np.full((t1.shape[0], n_q), np.nan)
    if not m.any():
        return out
    cnt = np.bincount(qs[m], minlength=n_q)
    for s in range(t1.shape[0]):
        tot = np.bincount(qs[m], weights=(t2[s] - t1[s])[m], minlength=n_q)
        out[s] = np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)
    return out


def strip(row: np.ndarray) -> str:
    """One character per queue: '#' / '+' / '.' by its execution relative to the row's median, ' ' where NaN."""
    med = np.nanmedian(row)
    return "".join(" " if np.isnan(v) else "#" if v > med * SLOW else "+" if v > med * SOME else "." for v in row)


def physical_sms(d, fam, queues) -> dict[int, list[int]]:
    """queue -> the physical SMs its block sat on in the traced steps (empty without smid records)."""
    if "smid" not in d:
        return {q: [] for q in queues}
    qs, smid = d["queue_sm"], d["smid"]
    out = {}
    for q in queues:
        first = np.where(qs == q)[0][0]
        out[q] = sorted({int(v) for v in smid[:, first]})
    return out


def report(d, gpcs: list[list[int]] | None, layers, partitions: list[list[int]] | None = None) -> list[str]:
    """gpcs / partitions: SM ids per GPC / per L2 partition (either may be None)."""
    with warnings.catch_warnings():   # nanmean over queues that run no task of a family
        warnings.simplefilter("ignore", RuntimeWarning)
        return _report(d, [("GPC", gpcs), ("L2 partition", partitions)], layers)


def l2_partitions(path: str) -> list[list[int]]:
    """SM ids per L2 partition from scripts/l2_home_micro.cu's l2_home_sm.bin (int32 per SM id, -1 unused)."""
    m = np.fromfile(path, dtype=np.int32)
    return [[int(i) for i in np.where(m == p)[0]] for p in range(int(m.max()) + 1)]


def _group_rel(d, E, groups) -> np.ndarray:
    """Per group of physical SMs: the mean over steps of its queues' execution / the step's median queue."""
    qs, smid = d["queue_sm"], d["smid"]
    rel = []
    for s in range(E.shape[0]):
        where = {}
        for q in range(E.shape[1]):
            if not np.isnan(E[s, q]):
                where[int(smid[s, np.where(qs == q)[0][0]])] = E[s, q] / np.nanmedian(E[s])
        rel.append([np.mean([where[x] for x in g if x in where]) if any(x in where for x in g) else np.nan
                    for g in groups])
    return np.nanmean(np.array(rel), axis=0)


def _report(d, groupings, layers) -> list[str]:
    fam, lay = families(d["label"])
    lines = []
    for f in FAMILIES:
        E = queue_exec(d, fam, lay, f, layers)
        if np.isnan(E).all():
            continue
        lines.append(f"{f}: per-step queue execution vs the median queue ('#' > {SLOW - 1:.0%}, '+' > {SOME - 1:.1%})")
        lines += [f"  step {s}: {strip(E[s])}" for s in range(E.shape[0])]
        mean = np.nanmean(E, axis=0)
        med = np.nanmedian(mean)
        slow = [int(q) for q in np.where(mean > med * SLOW)[0]]
        phys = physical_sms(d, fam, slow)
        lines.append(f"  median queue {med:.2f} us; slow queues ({len(slow)}): " +
                     (", ".join(f"{q} ({mean[q] / med - 1:+.0%}, SM {'/'.join(map(str, phys[q])) or '?'})"
                                for q in slow) or "none"))
        for what, groups in groupings:
            if groups and "smid" in d:
                r = _group_rel(d, E, groups)
                lines.append(f"  per {what} (size: mean execution vs the median queue): " +
                             "  ".join(f"{len(g)}: {v - 1:+.1%}" for g, v in zip(groups, r)))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--gpcs", help="scripts/gpc_probe.cu's JSON output")
    ap.add_argument("--l2map", help="scripts/l2_home_micro.cu's l2_home_sm.bin (the L2 partition of each SM)")
    ap.add_argument("--layers", default="2:14", help="layers to average, start:stop")
    a = ap.parse_args()
    d = dict(np.load(a.npz))
    gpcs = json.loads(pathlib.Path(a.gpcs).read_text())["gpcs"] if a.gpcs else None
    lo, hi = (int(x) for x in a.layers.split(":"))
    parts = l2_partitions(a.l2map) if a.l2map else None
    print("\n".join(report(d, gpcs, range(lo, hi), parts)))


if __name__ == "__main__":
    main()
