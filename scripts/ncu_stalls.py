"""Summarise scripts/ncu_source.sh's per-instruction CSV without a GPU (issue 4): the warp stall reasons over the
whole kernel and the hottest instructions with their top reasons.

    python scripts/ncu_stalls.py /path/to/ncu_llama-3.2-1b_512.sass.csv.gz [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def load(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of ncu's `--page source --csv --print-source sass` output (plain or gzipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [r for r in csv.reader(f)]
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1:]


def summarise(header: list[str], rows: list[list[str]], top: int) -> str:
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, h: int(r[col[h]] or 0) if col[h] < len(r) else 0  # noqa: E731
    total = collections.Counter({h: sum(num(r, h) for r in rows) for h in reasons})
    n = sum(total.values()) or 1
    out = [f"{n} warp samples over {len(rows)} instructions"]
    out += [f"  {h[6:]:20s} {v:9d} {100 * v / n:5.1f}%" for h, v in total.most_common() if v]
    hot = sorted(((sum(num(r, h) for h in reasons), k) for k, r in enumerate(rows)), reverse=True)[:top]
    out.append(f"top {top} instructions (index in address order, share, text, top reasons):")
    for s, k in hot:
        r = rows[k]
        why = sorted(((num(r, h), h[6:]) for h in reasons), reverse=True)[:2]
        out.append(f"  {k:6d} {100 * s / n:5.2f}%  {r[col['Source']].strip()[:48]:48s} "
                   + ", ".join(f"{w} {v}" for v, w in why if v))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    print(summarise(*load(a.csv), a.top))


if __name__ == "__main__":
    main()
