"""scripts/gpu_suite.py's pure parts (no GPU): the id range, the contiguous shards, the pytest -v parsing; and one
real run over a small CPU test file in two shards."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "scripts" / "gpu_suite.py")
gpu_suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_suite)

IDS = [f"tests/x.py::test_{i}" for i in range(1, 12)]   # 11 ids: an odd count on purpose


@pytest.mark.parametrize("k,sizes", [(1, [11]), (2, [6, 5]), (3, [4, 4, 3]), (4, [3, 3, 3, 2]), (20, [1] * 11)])
def test_shards_are_contiguous_and_cover_every_id_once(k, sizes):
    parts = gpu_suite.shard(IDS, k)
    assert [len(p) for p in parts] == sizes
    assert [t for p in parts for t in p] == IDS           # contiguous, in order, no id twice or lost


def test_range_is_one_based_and_inclusive():
    assert gpu_suite.pick_range(IDS, "3:5") == IDS[2:5]
    assert gpu_suite.pick_range(IDS, "10:") == IDS[9:]
    assert gpu_suite.pick_range(IDS, ":2") == IDS[:2]
    assert gpu_suite.pick_range(IDS, None) == IDS
    for bad in ("0:3", "5:4", "3:12", "7"):
        with pytest.raises(SystemExit, match="--range"):
            gpu_suite.pick_range(IDS, bad)


def test_parse_results_reads_pytest_v_lines():
    text = "\n".join([
        "tests/x.py::test_1 PASSED                                 [ 10%]",
        "tests/x.py::test_2[a-b] FAILED                            [ 20%]",
        "tests/x.py::test_3 SKIPPED (needs a CUDA GPU)             [ 30%]",
        "tests/x.py::test_4 PASSED                                 [ 40%]",
        "tests/x.py::test_4 ERROR                                  [ 40%]",   # teardown error after a pass
        "tests/x.py::test_5[args1-unknown model 'gpt-17'] PASSED   [ 50%]",   # an id with spaces and quotes
        "FAILED tests/x.py::test_2[a-b] - AssertionError",                   # the summary line is not a result
    ])
    assert gpu_suite.parse_results(text) == {"tests/x.py::test_1": "PASSED", "tests/x.py::test_2[a-b]": "FAILED",
                                             "tests/x.py::test_3": "SKIPPED", "tests/x.py::test_4": "ERROR",
                                             "tests/x.py::test_5[args1-unknown model 'gpt-17']": "PASSED"}


def test_two_shards_run_a_real_file(tmp_path):
    """The script end to end on a CPU test file: every id runs in one of the two shards, none fails."""
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_suite.py"), "tests/test_ab_builds.py",
                        "--shards", "2", "--budget", "300"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in 2 shards" in r.stdout and "FAILED" not in r.stdout and "NOT RUN" not in r.stdout, r.stdout
    logs = sorted(tmp_path.glob("gpu_suite_*_shard*.log"))
    assert len(logs) == 2 and all(" PASSED" in p.read_text() for p in logs)


FLAKY = """
import pathlib
import pytest


def test_fails_once():   # fails in its shard, passes when run again alone
    mark = pathlib.Path(__file__).with_name("ran_once")
    if not mark.exists():
        mark.write_text("x")
        assert False, "first run"


def test_always_fails():
    assert 1 + 1 == 3


@pytest.mark.parametrize("msg", ["unknown model 'gpt-17'", "plain"])
def test_ids_with_spaces(msg):
    assert msg
"""


def test_failures_run_again_alone_and_the_exit_status_says_so(tmp_path):
    (tmp_path / "test_flaky.py").write_text(FLAKY)
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_suite.py"), "test_flaky.py", "--root",
                        str(tmp_path), "--shards", "2", "--budget", "300"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "PASSED ALONE (failed next to another shard): test_flaky.py::test_fails_once" in r.stdout, r.stdout
    assert "FAILED: test_flaky.py::test_always_fails FAILED" in r.stdout, r.stdout
    assert "NOT RUN" not in r.stdout and "ERROR" not in r.stdout, r.stdout   # the ids with spaces were parsed
    assert "4 ids in 2 shards" in r.stdout


MANY = """
import pytest


@pytest.mark.parametrize("i", range(6))
def test_passes(i):
    assert i * i >= 0
"""


def test_two_runs_side_by_side_keep_their_own_logs(tmp_path):
    """Two runs at once into one $OUT (the fiftieth session's device call) each read only their own shards' logs:
    every id of both is reported passed, none 'not run'."""
    (tmp_path / "test_many.py").write_text(MANY)
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_suite.py"), "test_many.py", "--root", str(tmp_path),
           "--shards", "2", "--budget", "300"]
    runs = [subprocess.Popen(cmd + ["--range", rng], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for rng in ("1:4", "3:6")]
    outs = [p.communicate(timeout=600)[0] for p in runs]
    for p, out in zip(runs, outs):
        assert p.returncode == 0, out
        assert "4 ids in 2 shards" in out and "NOT RUN" not in out and out.count(", 2 passed (rc 0)") == 2, out
    assert len(list(tmp_path.glob("gpu_suite_*_shard*.log"))) == 4
