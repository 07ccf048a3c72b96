"""The flywheel's memory: every trial in ``<log_dir>/results.tsv``, every kept point in ``<log_dir>/corpus.jsonl``.

* ``results.tsv`` -- one row per evaluated schedule (kept or not), columns ``RESULTS_COLUMNS``; the header is written
  once, by whichever writer finds the file empty. ``experiment`` is a global running number (1, 2, ...) assigned
  under the lock, so rows from concurrent loops never collide or interleave.
* ``corpus.jsonl`` -- one JSON object per kept point: ``{"timestamp", "model", "gpu", "schedule_id", "tag",
  "config", "verdict"}``. ``flywheel.prior.best_corpus_point`` reads it to seed the next search.

``plot_trials`` draws a loop's latency per trial against the roofline floor (matplotlib optional).

Writers take an exclusive ``fcntl.flock`` on the data file itself for the whole read-count-append, readers a shared
one; a torn last line (a writer killed mid-write) is skipped by the readers, never fatal.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import time
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process lock, single writer assumed
    fcntl = None

RESULTS_FILE = "results.tsv"
CORPUS_FILE = "corpus.jsonl"
RESULTS_COLUMNS = ("experiment", "tag", "model", "gpu", "correctness", "latency_us", "pct_of_roofline",
                   "schedule_id", "description")


@contextlib.contextmanager
def _locked(path: pathlib.Path, mode: str, exclusive: bool) -> Iterator[Any]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode, encoding="utf-8") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield f
        finally:
            if fcntl is not None:
                f.flush()
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v).replace("\t", " ").replace("\r", " ").replace("\n", " ")


def results_path(log_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(log_dir) / RESULTS_FILE


def corpus_path(log_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(log_dir) / CORPUS_FILE


def append_result(log_dir: str | os.PathLike, row: dict) -> int:
    """Append one trial row (keys of ``RESULTS_COLUMNS``; ``experiment`` is assigned). Returns its number."""
    path = results_path(log_dir)
    with _locked(path, "a+", exclusive=True) as f:
        f.seek(0)
        text = f.read()
        if not text:
            f.write("\t".join(RESULTS_COLUMNS) + "\n")
            n = 0
        else:
            if not text.endswith("\n"):   # a torn line from a killed writer: terminate it, never glue onto it
                f.write("\n")
            n = sum(1 for line in text.splitlines()[1:] if line.strip())
        exp = n + 1
        cells = {**row, "experiment": exp}
        f.write("\t".join(_cell(cells.get(c)) for c in RESULTS_COLUMNS) + "\n")
    return exp


def read_results(log_dir: str | os.PathLike) -> list[dict]:
    """All rows of results.tsv as dicts of strings (empty cells -> ""); [] when there is no file."""
    path = results_path(log_dir)
    if not path.is_file():
        return []
    with _locked(path, "r", exclusive=False) as f:
        lines = f.read().splitlines()
    if not lines:
        return []
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]
            if line.strip() and len(line.split("\t")) == len(header)]


def append_corpus(log_dir: str | os.PathLike, model: str, gpu: str, config: dict, verdict: dict,
                  tag: str = "") -> dict:
    """Append one kept point to corpus.jsonl and return the record written."""
    rec = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model, "gpu": gpu,
           "schedule_id": verdict.get("schedule_id"), "tag": tag, "config": dict(config), "verdict": dict(verdict)}
    line = json.dumps(rec, default=str, sort_keys=True)
    with _locked(corpus_path(log_dir), "a+", exclusive=True) as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")
        f.write(line + "\n")
    return rec


def read_corpus(path: str | os.PathLike, model: str | None = None, gpu: str | None = None) -> list[dict]:
    """Corpus records (optionally only one model / GPU). ``path`` is corpus.jsonl or the log dir holding it."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / CORPUS_FILE
    if not p.is_file():
        return []
    with _locked(p, "r", exclusive=False) as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        if model is not None and rec.get("model") != model:
            continue
        if gpu is not None and rec.get("gpu") != gpu:
            continue
        out.append(rec)
    return out


def trial_row(verdict: dict, tag: str, description: str = "") -> dict:
    """A results.tsv row from a harness Verdict."""
    return {"tag": tag, "model": verdict.get("model"), "gpu": verdict.get("gpu"),
            "correctness": verdict.get("status"), "latency_us": verdict.get("latency_us"),
            "pct_of_roofline": verdict.get("pct_of_roofline"), "schedule_id": verdict.get("schedule_id"),
            "description": description}


def progress_bar(i: int, n: int, best: dict | None, t0: float, enabled: bool) -> None:
    """A one-line plain-text progress bar on stderr (no dependency)."""
    if not enabled:
        return
    width = 24
    done = int(width * i / max(n, 1))
    b = f"best {best['latency_us']:.2f} us ({best['latency_kind']})" if best else "best -"
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {b} {time.perf_counter() - t0:.0f}s ")
    if i >= n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def plot_trials(trials: list[dict], path: pathlib.Path, title: str) -> str | None:
    """PNG of latency per trial, best-so-far and the roofline floor. Returns a note when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    xs = [t["trial"] for t in trials]
    lat = [t["verdict"].get("latency_us") for t in trials]
    kept = [t for t in trials if t["kept"]]
    floor = next((t["verdict"]["bound_us"] for t in trials if t["verdict"].get("bound_us")), None)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.scatter([x for x, y in zip(xs, lat) if y is not None], [y for y in lat if y is not None], s=14,
               c="tab:blue", label="trial latency")
    bad = [x for x, y in zip(xs, lat) if y is None]
    if bad and any(y is not None for y in lat):
        ax.scatter(bad, [max(y for y in lat if y is not None)] * len(bad), marker="x", c="tab:red",
                   label="rejected / incorrect")
    best, ys = None, []
    for t in trials:
        if t["kept"]:
            best = t["verdict"]["latency_us"]
        ys.append(best)
    ax.step(xs, [y if y is not None else float("nan") for y in ys], where="post", c="tab:green", label="best so far")
    ax.scatter([t["trial"] for t in kept], [t["verdict"]["latency_us"] for t in kept], c="tab:green", s=30)
    if floor:
        ax.axhline(floor, ls="--", c="k", label=f"roofline floor {floor:.2f} us")
    kind = next((t["verdict"]["latency_kind"] for t in trials if t["verdict"].get("latency_kind")), "")
    ax.set(xlabel="trial", ylabel=f"us / token ({kind})", title=title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
