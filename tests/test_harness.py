"""harness.propose / evaluate / loop and the `amk propose|evaluate|loop` CLI, on CPU with the toy preset.

The GPU path is exercised with a fake ``eval.bench`` (measure_program / ab_compare) so the correctness gate, the
roofline guard and the A/B confirmation are tested without a GPU.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import types

import pytest

import harness
from flywheel import log as flog
from flywheel import prior
from schedule.ir import GpuTarget, IRError
from schedule.lower import schedule_id

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _rejected(v, field):
    assert v["valid"] is False and v["status"] == "REJECTED", v
    assert v["rejected_field"] == field, v
    assert field in v["rejected_reason"] or field in ("smem_per_block", "config", "model", "gpu", "device")
    assert v["latency_us"] is None and v["correct"] is None


@pytest.mark.parametrize("config,field", [
    ({"gemv_rows": "16"}, "gemv_rows"),                 # wrong type
    ({"fuse_norm": 1}, "fuse_norm"),                    # int for a bool
    ({"attn_splits": True}, "attn_splits"),             # bool for an int
    ({"warp_specialize": True}, "warp_specialize"),     # unknown key
    ({"threads_per_block": 500}, "threads_per_block"),  # not a multiple of 32
    ({"threads_per_block": 2048}, "threads_per_block"),  # out of range
    ({"gemv_rows": 7}, "gemv_rows"),                    # not a choice
    ({"attn_splits": -1}, "attn_splits"),
    ({"num_sms": 133}, "num_sms"),                      # more SMs than the H100 has
    ([1, 2], "config"),                                 # not an object
])
def test_malformed_config_is_rejected_naming_the_field(config, field):
    _rejected(harness.evaluate("toy", "h100", config, device="cpu"), field)


def test_over_cap_threads_and_smem_on_a_small_gpu():
    small = GpuTarget("tiny", 8, 12 * 1024, 500.0, 2 ** 20, "sm_80", max_threads_per_block=256)
    _rejected(harness.evaluate("toy", small, {"threads_per_block": 512}, device="cpu"), "threads_per_block")
    v = harness.evaluate("toy", small, {"threads_per_block": 256}, device="cpu")
    _rejected(v, "smem_per_block")
    assert v["smem_bytes"] == 4 * 176 + 16 * 1024 and "shared memory" in v["rejected_reason"]
    v = harness.evaluate("toy", {**small.to_dict(), "smem_per_block": 64 * 1024}, {"threads_per_block": 256},
                         device="cpu", verify_steps=0)
    assert v["valid"] and v["gpu"] == "tiny" and v["sms"] == 8


def test_unknown_model_gpu_device_are_verdicts_not_exceptions():
    _rejected(harness.evaluate("no-such-model", "h100", {}, device="cpu"), "model")
    _rejected(harness.evaluate("toy", "h999", {}, device="cpu"), "gpu")
    _rejected(harness.evaluate("toy", "h100", {}, device="tpu"), "device")
    if not harness._has_gpu():
        _rejected(harness.evaluate("toy", "h100", {}, device="cuda"), "device")


def test_validator_rejection_reports_first_errors(monkeypatch):
    import schedule.lower as lower_mod
    real = lower_mod.lower

    def broken(*a, **k):
        p = real(*a, **k)
        t = next(t for t in p.tasks if t.waits)
        t.waits[0].threshold += 1      # a wait that can never be satisfied
        return p
    monkeypatch.setattr(lower_mod, "lower", broken)
    v = harness.evaluate("toy", "h100", {}, device="cpu")
    _rejected(v, "program")
    assert "validator rejected" in v["rejected_reason"] and "deadlock" in v["rejected_reason"]


def test_valid_toy_config_passes_with_predicted_latency():
    cfg = {"gemv_rows": 8, "attn_splits": 2}
    v = harness.evaluate("toy", "h100", cfg, device="cpu")
    assert v["valid"] and v["correct"] is True and v["status"] == "PASS", v
    assert v["top1_agreement"] == 1.0 and v["max_abs_err"] < 1e-4
    assert v["latency_kind"] == "predicted" and v["latency_us"] == v["predicted_us"] > v["bound_us"] > 0
    assert v["pct_of_roofline"] == pytest.approx(100 * v["bound_us"] / v["latency_us"])
    assert v["schedule_id"] == schedule_id({**prior.defaults(), **cfg}) and v["config"]["gemv_rows"] == 8
    assert v["tasks"] > 0 and v["weight_mb"] > 0 and v["verify_steps"] == 4
    json.dumps(v)   # a verdict is plain JSON


def test_incorrect_program_gets_no_latency(monkeypatch):
    import schedule.lower as lower_mod
    real = lower_mod.lower

    def wrong(*a, **k):
        p = real(*a, **k)
        for t in p.tasks:
            if t.op == "GEMV" and "lm_head" in t.label:
                t.params["eps"] = 10.0   # still valid, numerically wrong
        return p
    monkeypatch.setattr(lower_mod, "lower", wrong)
    v = harness.evaluate("toy", "h100", {}, device="cpu")
    assert v["valid"] and v["correct"] is False and v["status"] == "FAIL"
    assert v["latency_us"] is None and v["latency_kind"] is None and v["pct_of_roofline"] is None


def test_latency_below_the_floor_is_withheld(monkeypatch):
    import schedule.cost_model as cm
    monkeypatch.setattr(cm, "predict_us", lambda *a, **k: 1e-6)
    v = harness.evaluate("toy", "h100", {}, device="cpu", verify_steps=1)
    assert v["correct"] is True and v["latency_us"] is None and v["latency_kind"] is None
    assert any("below the roofline floor" in n for n in v["notes"])


def test_big_models_on_cpu_are_unverified_but_predicted(monkeypatch):
    monkeypatch.setattr(harness, "CPU_VERIFY_MAX_PARAMS", 1000)   # pretend the toy is big
    v = harness.evaluate("toy", "h100", {}, device="cpu")
    assert v["valid"] and v["correct"] is None and v["status"] == "UNVERIFIED"
    assert v["latency_kind"] == "predicted" and v["latency_us"] is not None
    assert any("not checked" in n for n in v["notes"])


class FakeBench:
    def __init__(self, correct=True, latency=5.0, ab=(10.0, 10.0)):
        self.correct, self.latency, self.ab, self.calls, self.ab_calls = correct, latency, ab, 0, 0

    def module(self):
        m = types.ModuleType("eval.bench")

        def measure_program(program, graph, ctx=512, iters=50, repeats=7, check_steps=4, vm=None):
            assert ctx < program.meta["max_seq"]
            self.calls += 1
            lat = self.latency(program) if callable(self.latency) else self.latency
            return {"correct": self.correct, "max_abs_err": 0.0, "max_rel_err": 0.0, "top1_agreement": 1.0,
                    "latency_us": lat if self.correct else None, "latency_kind": "measured-gpu", "note": "fake"}

        def ab_compare(a, b, graph, ctx=512, rounds=6):
            self.ab_calls += 1
            return {"a_us": self.ab[0], "b_us": self.ab[1], "speedup": self.ab[0] / self.ab[1]}
        m.measure_program, m.ab_compare = measure_program, ab_compare
        return m


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(bench: FakeBench):
        monkeypatch.setattr(harness, "_has_gpu", lambda: True)
        monkeypatch.setitem(sys.modules, "eval.bench", bench.module())
        return bench
    return install


def test_gpu_path_gates_latency_on_correctness(fake_gpu):
    b = fake_gpu(FakeBench(correct=True, latency=50.0))
    v = harness.evaluate("toy", "h100", {}, device="auto")
    assert v["device"] == "cuda" and v["latency_kind"] == "measured-gpu" and v["latency_us"] == 50.0
    assert v["correct"] is True and b.calls == 1 and "fake" in v["notes"]
    b.correct = False
    v = harness.evaluate("toy", "h100", {}, device="cuda")
    assert v["correct"] is False and v["latency_us"] is None and v["status"] == "FAIL"
    b.correct, b.latency = True, 1e-4   # faster than physics
    v = harness.evaluate("toy", "h100", {}, device="cuda")
    assert v["latency_us"] is None and any("below the roofline floor" in n for n in v["notes"])


def test_gpu_loop_confirms_winners_by_ab(fake_gpu, tmp_path):
    # every config but the default measures faster on its own; the A/B says: no gain
    b = fake_gpu(FakeBench(latency=lambda p: 100.0 if p.config == prior.defaults() else 90.0, ab=(10.0, 10.0)))
    r = harness.loop("toy", "h100", budget=4, device="cuda", log_dir=tmp_path, progress=False, plot=False)
    assert [t["kept"] for t in r["trials"]][0] is True and b.calls == 4 and b.ab_calls > 0
    for t in r["trials"][1:]:
        if t["ab"] is not None:
            assert not t["kept"] and "A/B did not confirm" in t["why"]
    b.ab = (10.0, 5.0)   # now A/B confirms a 2x win
    r = harness.loop("toy", "h100", budget=6, device="cuda", log_dir=tmp_path / "2", progress=False, plot=False,
                     seed=3)
    assert all(t["kept"] for t in r["trials"] if t["ab"] is not None)
    assert b.ab_calls > 0


def test_loop_on_cpu_logs_every_trial(tmp_path):
    r = harness.loop("toy", "h100", budget=5, device="cpu", log_dir=tmp_path, progress=False, plot=False)
    assert len(r["trials"]) == 5 and [t["trial"] for t in r["trials"]] == list(range(5))
    lines = (tmp_path / "results.tsv").read_text().splitlines()
    assert len(lines) == 6 and lines[0].split("\t") == list(flog.RESULTS_COLUMNS)
    best = r["best_verdict"]
    assert best["correct"] is True and best["latency_kind"] == "predicted"
    assert best["latency_us"] == min(t["verdict"]["latency_us"] for t in r["trials"] if t["kept"])
    kinds = [t["kind"] for t in r["trials"]]
    assert kinds[0] == "defaults" and "explore" in kinds and "mutate" in kinds
    assert len({t["verdict"]["schedule_id"] for t in r["trials"]}) == 5      # no config tried twice
    corpus = flog.read_corpus(tmp_path, model="toy", gpu="h100")
    assert len(corpus) == sum(t["kept"] for t in r["trials"])
    # the next loop (and propose) start from the best corpus point
    p = harness.propose("toy", "h100", log_dir=tmp_path)
    assert p["source"] == "corpus" and p["config"] == r["best_config"]
    r2 = harness.loop("toy", "h100", budget=1, device="cpu", log_dir=tmp_path, progress=False, plot=False)
    assert r2["trials"][0]["kind"] == "corpus" and r2["trials"][0]["config"] == r["best_config"]
    assert len((tmp_path / "results.tsv").read_text().splitlines()) == 7


def test_propose(tmp_path):
    p = harness.propose("toy", "h100", log_dir=tmp_path)
    assert p["source"] == "defaults" and p["config"] == prior.defaults()
    assert p["schedule_id"] == schedule_id(prior.defaults()) and p["search_space"] == harness.search_space()
    assert p["suggestions"] and all(1 <= len(s["changed"]) <= 2 for s in p["suggestions"])
    p = harness.propose("toy", "h100", incumbent={"gemv_rows": 8}, log_dir=tmp_path)
    assert p["source"] == "incumbent" and p["config"]["gemv_rows"] == 8 and len(p["config"]) == len(prior.KNOBS)
    with pytest.raises(IRError, match="gemv_rows"):
        harness.propose("toy", "h100", incumbent={"gemv_rows": 7})
    with pytest.raises(IRError, match="unknown GPU"):
        harness.propose("toy", "h999")


def test_cli(tmp_path, capsys):
    rc = harness.main_cli(["evaluate", "toy", "--device", "cpu", "--config-json", '{"gemv_rows": "x"}', "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["valid"] is False and out["rejected_field"] == "gemv_rows"
    rc = harness.main_cli(["evaluate", "toy", "--device", "cpu", "--config-json", "{not json", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["rejected_field"] == "config"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"gemv_rows": 32}))
    rc = harness.main_cli(["evaluate", "toy", "--device", "cpu", "--config", str(cfg), "--verify-steps", "2",
                           "--log-dir", str(tmp_path), "--keep", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["status"] == "PASS" and out["config"]["gemv_rows"] == 32
    assert len(flog.read_results(tmp_path)) == 1 and len(flog.read_corpus(tmp_path)) == 1
    rc = harness.main_cli(["propose", "toy", "--log-dir", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["source"] == "corpus" and out["config"]["gemv_rows"] == 32
    rc = harness.main_cli(["propose", "toy", "--gpu", "h999"])
    assert rc == 2 and capsys.readouterr().err.startswith("amk: error: unknown GPU")
    rc = harness.main_cli(["evaluate", "toy", "--config", str(tmp_path / "missing.json")])
    assert rc == 2 and "cannot read" in capsys.readouterr().err
    rc = harness.main_cli(["loop", "toy", "--device", "cpu", "--budget", "2", "--verify-steps", "1",
                           "--log-dir", str(tmp_path / "l"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["trials"]) == 2 and out["best_verdict"]["correct"] is True


def test_spearman_in_cost_model_rank_script():
    spec = importlib.util.spec_from_file_location("cost_model_rank", ROOT / "scripts" / "cost_model_rank.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.ranks([3, 1, 2, 2]) == [4.0, 1.0, 2.5, 2.5]
    assert mod.spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert mod.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert mod.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486833)
    recs = [{"config": {}, "latency_us": m, "predicted_us": p, "latency_kind": "measured-gpu"}
            for p, m in [(1, 2), (2, 3), (3, 1)]] + [{"config": {}, "latency_us": None, "predicted_us": 1}]
    res = mod.rank_records(recs)
    assert res["n"] == 3 and res["skipped"] == 1 and res["spearman"] == pytest.approx(-0.5)


def test_multi_step_config_checks_every_step_of_the_last_launch():
    """steps_per_launch 3: the CPU check compares each launch's first step (4 launches) and the last launch's two
    greedy steps against transformers on the reference VM's own tokens: 6 compared steps."""
    v = harness.evaluate("toy", "h100", {"steps_per_launch": 3}, device="cpu")
    assert v["correct"] is True and v["status"] == "PASS", v
    assert v["verify_steps"] == 4 + 2 and v["top1_agreement"] == 1.0 and v["max_abs_err"] < 1e-4
    assert v["latency_kind"] == "predicted" and v["latency_us"] > v["bound_us"]
