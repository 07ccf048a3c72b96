"""Device script (issue 4 sessions): run a GPU test file as K concurrent pytest shards on one machine.

    python scripts/gpu_suite.py tests/vm/test_megakernel_gpu.py [-k EXPR] [--shards 2] [--range 111:145]
        [--budget 560]

A fresh device machine spends most of a GPU-suite call building extensions: since the forty-eighth session every
distinct program op set has its own build, and `tests/vm/test_megakernel_gpu.py` did not finish in two 9.5-minute
calls run as one pytest process. Shards are separate pytest processes that share the build cache (AMK_CACHE_DIR;
`vm.jit.build` serialises builds of one extension with a file lock), so their builds and tests run side by side
(the forty-ninth session: 35 tests in 7.4 minutes as two shards). Each shard takes a contiguous slice of the node
ids, so the neighbouring parametrizations that share a build stay together.

--range A:B keeps the collected ids A..B (1-based, inclusive, in collection order) -- to go on in a later call.
--budget S stops each shard after S seconds (a build killed mid-way is safe: `vm.jit.build` clears torch's stale
build baton). The shards share one GPU, so a timing assertion can fail next to another shard's kernels (the
forty-ninth session: a tiny model's decode timed at 0.0% of its roofline): in the time the budget leaves, the
failed ids run again in one process, and those that pass alone are listed as such (--no-rerun: not). The last lines are a table per shard and the ids that failed or did not run; the exit status is 1
if any test failed or errored or a shard's pytest itself failed (a usage error, nothing collected), else 0 (ids the
budget left unrun are listed, not failed). Paths lie inside the repository (the ids run from its root), or in --root. Logs: $OUT/gpu_suite_PID_shard*.log
(or /tmp without $OUT; the process id keeps two runs side by side from writing into each other's logs, which the
fiftieth session's first try of that did, and read as ids not run).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# a `pytest -v` result line: the node id (parametrized ids may hold spaces), the outcome, then " [ NN%]" or a reason
_RESULT = re.compile(r"^(\S+::.+?) (" + "|".join(OUTCOMES) + r")(?: |$)")


def collect(paths: list[str], kexpr: str | None, root: pathlib.Path = ROOT) -> list[str]:
    """The node ids pytest collects for paths (and -k), in collection order, run from root."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths]
    if kexpr:
        cmd += ["-k", kexpr]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if not ids:
        raise SystemExit(f"gpu_suite: pytest collected no tests from {paths}:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return ids


def pick_range(ids: list[str], spec: str | None) -> list[str]:
    """ids A..B of 'A:B' (1-based, inclusive; either end may be left out)."""
    if not spec:
        return ids
    a, sep, b = spec.partition(":")
    if not sep:
        raise SystemExit(f"gpu_suite: --range {spec!r} must be A:B")
    lo, hi = int(a) if a else 1, int(b) if b else len(ids)
    if not 1 <= lo <= hi <= len(ids):
        raise SystemExit(f"gpu_suite: --range {spec!r} is outside 1:{len(ids)}")
    return ids[lo - 1:hi]


def shard(ids: list[str], k: int) -> list[list[str]]:
    """k contiguous slices of ids, sizes differing by at most one (empty slices dropped)."""
    k = max(1, min(k, len(ids)))
    q, r = divmod(len(ids), k)
    out, at = [], 0
    for i in range(k):
        n = q + (i < r)
        out.append(ids[at:at + n])
        at += n
    return [s for s in out if s]


def parse_results(text: str) -> dict[str, str]:
    """node id -> outcome, from `pytest -v` lines (a test that errors in teardown after passing reports ERROR)."""
    res: dict[str, str] = {}
    for ln in text.splitlines():
        m = _RESULT.match(ln.strip())
        if m and (res.get(m.group(1)) in (None, "PASSED") or m.group(2) == "ERROR"):
            res[m.group(1)] = m.group(2)
    return res


def log_path(out: pathlib.Path, tag: str, i: int) -> pathlib.Path:
    """Part i's log: named by this process, so concurrent runs of the script never share one."""
    return out / f"gpu_suite_{os.getpid()}_{tag}{i}.log"


def run_shards(parts: list[list[str]], budget: int, out: pathlib.Path, tag: str,
               root: pathlib.Path = ROOT) -> list[tuple[list[str], int, dict]]:
    """Each part as one pytest process, all at once; per part (ids, exit status, id -> outcome)."""
    procs = []
    for i, part in enumerate(parts):
        log = open(log_path(out, tag, i), "w")
        cmd = ["timeout", "--signal=INT", "--kill-after=20", str(budget), sys.executable, "-m", "pytest", "-v",
               "-p", "no:cacheprovider", *part]
        procs.append((subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT), log))
    res = []
    for i, (p, log) in enumerate(procs):
        rc = p.wait()
        log.close()
        res.append((parts[i], rc, parse_results(log_path(out, tag, i).read_text(errors="replace"))))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("-k", dest="kexpr", default=None)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--range", dest="rng", default=None)
    ap.add_argument("--budget", type=int, default=560, help="seconds for the whole run (shards, then the reruns)")
    ap.add_argument("--root", type=pathlib.Path, default=ROOT,
                    help="the directory pytest runs in; paths and ids are relative to it (default: the repository)")
    ap.add_argument("--no-rerun", dest="rerun", action="store_false",
                    help="do not run failed ids again alone in the time left")
    a = ap.parse_args()
    ids = pick_range(collect(a.paths, a.kexpr, a.root), a.rng)
    parts = shard(ids, a.shards)
    out = pathlib.Path(os.environ.get("OUT") or "/tmp")
    t0 = time.monotonic()
    failed, unrun, rows, broken = [], [], [], []
    for i, (part, rc, res) in enumerate(run_shards(parts, a.budget, out, "shard", a.root)):
        counts = {o: sum(1 for t in part if res.get(t) == o) for o in OUTCOMES}
        left = [t for t in part if t not in res]
        failed += [t for t in part if res.get(t) in ("FAILED", "ERROR", "XPASS")]
        unrun += left
        done = ", ".join(f"{v} {o.lower()}" for o, v in counts.items() if v) or "nothing ran"
        rows.append(f"shard {i}: {len(part):4d} ids, {done}" + (f", {len(left)} not run" if left else "")
                    + f" (rc {rc}{': budget spent' if rc == 124 else ''})")
        if rc in (2, 3, 4, 5):   # pytest interrupted, internal or usage error, nothing collected (124: the budget)
            broken.append(f"shard {i}: pytest exited {rc}, see {log_path(out, 'shard', i)}")
    print(f"gpu_suite: {len(ids)} ids in {len(parts)} shards")
    print("\n".join(rows))
    # the shards share one GPU: a timing assertion can fail under another shard's load, so failures run again alone
    left_s = a.budget - int(time.monotonic() - t0)
    if failed and a.rerun and left_s > 30:
        _, rc, res = run_shards([failed], left_s, out, "rerun", a.root)[0]
        alone = [t for t in failed if res.get(t) == "PASSED"]
        for t in alone:
            print("PASSED ALONE (failed next to another shard):", t)
        failed = [f"{t} {res.get(t, 'not rerun')}" for t in failed if t not in alone]
    for t in failed:
        print("FAILED:", t)
    for t in unrun:
        print("NOT RUN:", t)
    for b in broken:
        print("ERROR:", b)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
