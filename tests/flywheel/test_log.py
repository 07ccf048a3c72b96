"""flywheel/log.py (results.tsv, corpus.jsonl, locking) and the prior's corpus reader / samplers."""
from __future__ import annotations

import json
import multiprocessing as mp
import random

from flywheel import log as flog
from flywheel import prior
from schedule.ir import ScheduleConfig, get_target


def _verdict(lat, kind="predicted", correct=True, tasks=10, sid="abc"):
    return {"model": "toy", "gpu": "h100", "status": "PASS" if correct else "FAIL", "latency_us": lat,
            "latency_kind": kind, "correct": correct, "tasks": tasks, "pct_of_roofline": 1.5, "schedule_id": sid}


def test_results_header_once_and_numbered_rows(tmp_path):
    for i in range(3):
        n = flog.append_result(tmp_path, flog.trial_row(_verdict(10.0 + i), "t", f"row {i}\twith tab\nand newline"))
        assert n == i + 1
    lines = (tmp_path / "results.tsv").read_text().splitlines()
    assert lines[0].split("\t") == list(flog.RESULTS_COLUMNS)
    assert len(lines) == 4 and all(len(line.split("\t")) == len(flog.RESULTS_COLUMNS) for line in lines)
    rows = flog.read_results(tmp_path)
    assert [r["experiment"] for r in rows] == ["1", "2", "3"]
    assert rows[1]["latency_us"] == "11.000" and rows[1]["correctness"] == "PASS"
    assert rows[2]["description"] == "row 2 with tab and newline"


def test_missing_files_read_as_empty(tmp_path):
    assert flog.read_results(tmp_path / "nope") == []
    assert flog.read_corpus(tmp_path / "nope") == []
    assert prior.best_corpus_point("toy", "h100", str(tmp_path / "corpus.jsonl")) is None


def test_torn_lines_are_tolerated(tmp_path):
    flog.append_corpus(tmp_path, "toy", "h100", prior.defaults(), _verdict(5.0))
    with open(tmp_path / "corpus.jsonl", "a") as f:
        f.write('{"model": "toy", "conf')           # a writer killed mid-line
    flog.append_corpus(tmp_path, "toy", "h100", prior.defaults(), _verdict(4.0))
    recs = flog.read_corpus(tmp_path)
    assert [r["verdict"]["latency_us"] for r in recs] == [5.0, 4.0]
    flog.append_result(tmp_path, flog.trial_row(_verdict(1.0), "t"))
    with open(tmp_path / "results.tsv", "a") as f:
        f.write("2\tt\ttoy")
    assert flog.append_result(tmp_path, flog.trial_row(_verdict(2.0), "t")) == 3
    assert [r["latency_us"] for r in flog.read_results(tmp_path)] == ["1.000", "2.000"]


def _writer(args):
    d, k = args
    for i in range(40):
        flog.append_result(d, flog.trial_row(_verdict(float(i)), f"w{k}", "x" * 300))
        flog.append_corpus(d, "toy", "h100", prior.defaults(), _verdict(float(i)), tag=f"w{k}")


def test_concurrent_writers_do_not_interleave(tmp_path):
    with mp.get_context("fork").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), k) for k in range(4)])
    lines = (tmp_path / "results.tsv").read_text().splitlines()
    assert lines[0].startswith("experiment\t") and sum(1 for line in lines if line.startswith("experiment")) == 1
    rows = flog.read_results(tmp_path)
    assert len(rows) == 160 and sorted(int(r["experiment"]) for r in rows) == list(range(1, 161))
    corpus_lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    assert len(corpus_lines) == 160 and all(json.loads(line)["model"] == "toy" for line in corpus_lines)


def test_best_corpus_point_ranking(tmp_path):
    d = prior.defaults()
    flog.append_corpus(tmp_path, "toy", "h100", {**d, "gemv_rows": 8}, _verdict(3.0))              # predicted
    flog.append_corpus(tmp_path, "toy", "h100", {**d, "gemv_rows": 32}, _verdict(9.0, "measured-gpu"))
    flog.append_corpus(tmp_path, "toy", "h100", {**d, "gemv_rows": 64}, _verdict(1.0, "measured-gpu", False))
    flog.append_corpus(tmp_path, "toy", "h100", {**d, "gone_knob": 1}, _verdict(0.5, "measured-gpu"))
    flog.append_corpus(tmp_path, "toy", "a100", {**d, "gemv_rows": 4}, _verdict(0.1, "measured-gpu"))
    flog.append_corpus(tmp_path, "llama-3.2-1b", "h100", {**d, "gemv_rows": 4}, _verdict(0.1, "measured-gpu"))
    best = prior.best_corpus_point("toy", "h100", str(tmp_path / "corpus.jsonl"))
    assert best["config"]["gemv_rows"] == 32      # measured beats predicted; incorrect / stale / other GPU skipped
    assert prior.best_corpus_point("toy", "a100", str(tmp_path))["config"]["gemv_rows"] == 4
    assert len(flog.read_corpus(tmp_path, model="toy", gpu="h100")) == 4


def test_samplers_stay_inside_the_space():
    rng, t = random.Random(1), get_target("h100")
    for _ in range(200):
        cfg = prior.random_config(rng, t)
        assert all(prior.KNOB_BY_NAME[k].check(v) is None for k, v in cfg.items())
        assert cfg["num_sms"] <= t.sm_count and cfg["threads_per_block"] <= t.max_threads_per_block
        ScheduleConfig(**cfg)   # every sampled point is a config the IR accepts (the ring's window below its stages)
        new, changed = prior.mutate(cfg, rng, t)
        diff = [k for k in cfg if cfg[k] != new[k]]
        repairs = [c for c in changed if "(below ring_stages)" in c]   # prior.consistent's moves
        assert len(diff) <= len(changed) and len(changed) - len(repairs) <= 2
        assert all(prior.KNOB_BY_NAME[k].check(v) is None for k, v in new.items())
        ScheduleConfig(**new)


def test_mutation_moves_to_neighbours():
    rng = random.Random(0)
    for _ in range(100):
        new, changed = prior.mutate(prior.defaults(), rng, n_changes=1)
        for k in prior.KNOBS:
            vals = prior.candidate_values(k)
            if new[k.name] != k.default and k.type is int:
                assert abs(vals.index(new[k.name]) - vals.index(k.default)) == 1, changed
