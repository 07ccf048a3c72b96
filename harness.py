"""The agent-facing search surface: ``propose`` a schedule, ``evaluate`` it honestly, ``loop`` keep/revert search.

An agent owns exactly one thing, a ScheduleConfig JSON (schema: ``schemas/schedule_config.schema.json``). Everything
else -- lowering, validation, the correctness gate, timing, logging -- is the harness's, and HARNESS.md is the contract.

    from harness import propose, evaluate, loop
    p = propose("toy", "h100")                                  # incumbent: corpus best, else defaults
    v = evaluate("toy", "h100", {**p["config"], "gemv_rows": 8}) # a Verdict dict, never an exception
    r = loop("toy", "h100", budget=20, device="cpu")            # explore, then mutate the best; logs everything

Evaluation order (each stage can end it with ``valid=False`` and the field at fault in ``rejected_field``):
device -> GPU target -> config (types, keys, ranges, GPU caps) -> model -> lowering -> shared memory -> validator ->
correctness (CPU: ReferenceVM vs transformers eager; GPU: ``eval.bench.measure_program``) -> latency.
No latency without a correctness PASS (a big model on CPU is the one exception: ``correct=None`` with a predicted
latency, labelled as such); a latency under the roofline floor is withheld as an artifact.
"""
from __future__ import annotations

import math
import os
import pathlib
import random
import sys
import time
from typing import Any

from flywheel import log as flog
from flywheel import prior

CPU_VERIFY_MAX_PARAMS = 50_000_000     # above this, CPU correctness (HF eager fp32 + reference VM) is skipped
SMEM_SCRATCH_BYTES = 16 * 1024         # per-block scratch (reductions, counters) on top of the fp32 input vector
GEMV_LIKE_OPS = ("GEMV", "GEMV_SILU_MUL", "GEMV_SILU_MUL_DOWN", "QKV_ROPE")   # ops that stage their fp32 input vector (length k) in SMEM
MAX_ERRORS_REPORTED = 5

_GRAPHS: dict = {}       # (model, dtype, seed) -> ModelGraph (weights materialised once per process)
_HF: dict = {}           # (model, dtype, seed) -> transformers eager model (fp32), the correctness reference
_REF_LOGITS: dict = {}   # (model, dtype, seed, tokens) -> HF logits [T, vocab]


def search_space() -> list[dict]:
    """Every knob with its type, default, choices or range, what it affects and what it means."""
    return prior.search_space()


def clear_cache() -> None:
    """Drop cached graphs, reference models and reference logits (frees their memory)."""
    _GRAPHS.clear(), _HF.clear(), _REF_LOGITS.clear()


def smem_required(program) -> int:
    """Dynamic shared memory one persistent block needs: the largest GEMV input vector in fp32 + 16 KB scratch."""
    k = max((int(t.params.get("k", 0)) for t in program.tasks if t.op in GEMV_LIKE_OPS), default=0)
    return 4 * k + SMEM_SCRATCH_BYTES


# -- resolution helpers ----------------------------------------------------------------------------------------
def _target(gpu):
    from schedule.ir import GpuTarget, IRError, get_target
    if isinstance(gpu, GpuTarget):
        return gpu
    if isinstance(gpu, dict):
        try:
            return GpuTarget.from_dict(gpu)
        except TypeError as e:
            raise IRError(f"GpuTarget: {e}") from None
    if not isinstance(gpu, str):
        raise IRError(f"gpu must be a name (h100, ...) or a GpuTarget, got {type(gpu).__name__}")
    return get_target(gpu)


def _default_dtype(model_id: str) -> str | None:
    from schedule.graph import PRESETS
    return ("f32" if model_id == "toy" else "bf16") if model_id in PRESETS else None


def _graph(model_id: str, dtype: str | None, seed: int):
    from schedule.graph import load_model
    key = (str(model_id), dtype, int(seed))
    if key not in _GRAPHS:
        _GRAPHS[key] = load_model(model_id, dtype=dtype, seed=seed)
    return _GRAPHS[key]


def _check_model_name(model_id: str) -> None:
    from schedule.graph import PRESETS, GraphError
    if str(model_id) not in PRESETS and not pathlib.Path(str(model_id)).is_dir():
        raise GraphError(f"unknown model or preset {model_id!r}; presets: {', '.join(PRESETS)} "
                         "(or pass a Hugging Face checkpoint directory)")


def _param_count(graph) -> int:
    from schedule.graph import weight_shapes
    return sum(math.prod(s) for s in weight_shapes(graph.config).values())


def _has_gpu() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _live_gpu_name() -> str | None:
    try:
        import torch
        from schedule.ir import guess_target_name
        name = torch.cuda.get_device_name()
        return guess_target_name(name) or name
    except Exception:
        return None


def check_config(config: Any, target=None) -> tuple[dict | None, str | None, str | None]:
    """(normalised config, None, None) or (None, field, reason). Never raises."""
    if not isinstance(config, dict):
        return None, "config", f"config must be a JSON object, got {type(config).__name__}"
    errs: list[tuple[str, str]] = []
    for k, v in config.items():
        if k not in prior.KNOB_BY_NAME:
            errs.append((str(k), f"unknown config key '{k}' (known: {', '.join(sorted(prior.KNOB_BY_NAME))})"))
        else:
            msg = prior.KNOB_BY_NAME[k].check(v)
            if msg:
                errs.append((k, msg))
    if errs:
        return None, errs[0][0], "; ".join(m for _, m in errs)
    from schedule.ir import IRError, ScheduleConfig
    try:
        cfg = ScheduleConfig.from_dict(config)
    except IRError as e:   # the IR may add rules of its own; keep its message (it names the field)
        field = next((k for k in prior.KNOB_BY_NAME if k in str(e)), "config")
        return None, field, str(e)
    if target is not None:
        terrs = cfg.check_target(target)
        if terrs:
            return None, terrs[0].split(":")[0], "config does not fit the target: " + "; ".join(terrs)
    return cfg.to_dict(), None, None


# -- evaluate ------------------------------------------------------------------------------------------------
def _gpu_name(gpu) -> str:
    if isinstance(gpu, str):
        return gpu
    if isinstance(gpu, dict):
        return str(gpu.get("name"))
    return str(getattr(gpu, "name", gpu))


def _blank(model_id, gpu, config, device, ctx) -> dict:
    gname = _gpu_name(gpu)
    return {"model": str(model_id), "gpu": gname, "device": device, "ctx": ctx, "config": config,
            "valid": False, "rejected_reason": None, "rejected_field": None, "status": "REJECTED",
            "correct": None, "max_abs_err": None, "max_rel_err": None, "top1_agreement": None, "verify_steps": 0,
            "latency_us": None, "latency_kind": None, "predicted_us": None, "pct_of_roofline": None,
            "bound_us": None, "schedule_id": None, "tasks": None, "sms": None, "weight_mb": None,
            "smem_bytes": None, "dtype": None, "seconds": None, "notes": []}


def _reject(v: dict, field: str | None, reason: str) -> dict:
    v.update(valid=False, rejected_field=field, rejected_reason=reason, status="REJECTED")
    return v


def _reference_logits(model_id, graph, seed, tokens):
    from eval.equivalence import hf_logits
    gkey = (str(model_id), graph.dtype, int(seed))
    key = gkey + (tuple(tokens),)
    if key not in _REF_LOGITS:
        if gkey not in _HF:
            _HF[gkey] = graph.hf_model(dtype="f32")
        _REF_LOGITS[key] = hf_logits(_HF[gkey], list(tokens))
    return _REF_LOGITS[key]


def _cpu_correctness(v, model_id, graph, prog, n_steps, seed) -> None:
    import torch
    from eval.equivalence import compare_logits, describe_failures, summarize
    from schedule.ir import step_name
    from vm.reference_vm import ReferenceVM, VMError
    per_launch = int(prog.meta.get("steps_per_launch", 1))   # a launch from position i also runs i+1 .. i+N-1
    n = max(1, min(int(n_steps), int(prog.meta.get("max_seq", n_steps)) - per_launch + 1))
    rng = torch.Generator().manual_seed(int(seed) + 1)
    toks = torch.randint(0, graph.config.vocab, (n,), generator=rng).tolist()
    ref = _reference_logits(model_id, graph, seed, toks)
    try:
        vm = ReferenceVM(prog, graph.weights, seed=seed, check=False)   # validate() already passed
        rows = [compare_logits(vm.step(t, i), ref[i], graph.dtype) for i, t in enumerate(toks)]
        if per_launch > 1:   # the last launch's greedy steps: against transformers on the VM's own tokens
            got = vm.step_logits()[1:]
            follow = [int(vm.io(step_name("next_token", s))[0]) for s in range(per_launch - 1)]
            ref2 = _reference_logits(model_id, graph, seed, toks + follow)
            rows += [compare_logits(got[s], ref2[n + s], graph.dtype) for s in range(per_launch - 1)]
    except VMError as e:
        v.update(correct=False, status="FAIL")
        v["notes"].append(f"reference VM failed: {str(e).splitlines()[0]}")
        return
    s = summarize(rows)
    v.update(correct=bool(s["passed"] and s["top1_agreement"] == 1.0), max_abs_err=s["max_abs_err"],
             max_rel_err=s["max_rel_err"], top1_agreement=s["top1_agreement"], verify_steps=s["steps"])
    v["notes"].append(f"correctness: reference VM (random legal order, seed {seed}) vs transformers eager fp32, "
                      f"{s['steps']} steps, {graph.dtype} tolerances")
    if s["top1_misses"] or s["over_tolerance"]:
        v["notes"].append(describe_failures(s))


def _evaluate(model_id, gpu, config, device="auto", ctx=512, verify_steps=4, seed=0, dtype=None,
              max_seq=None, bench_kwargs=None) -> tuple[dict, Any, Any]:
    """evaluate() plus the lowered program and graph (for A/B confirmation in loop)."""
    from schedule.graph import GraphError
    from schedule.ir import IRError, validate
    t0 = time.perf_counter()
    v = _blank(model_id, gpu, config, device, ctx)
    # 1. device
    if device not in ("auto", "cpu", "cuda", "gpu"):
        return _reject(v, "device", f"device: {device!r} is not one of auto, cpu, cuda"), None, None
    on_gpu = _has_gpu() if device == "auto" else device in ("cuda", "gpu")
    if on_gpu and not _has_gpu():
        return _reject(v, "device", f"device: {device!r} requested but no CUDA GPU is available"), None, None
    v["device"] = "cuda" if on_gpu else "cpu"
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
        return _reject(v, "ctx", f"ctx: expected a positive integer, got {ctx!r}"), None, None
    # 2. target, 3. config
    try:
        target = _target(gpu)
    except IRError as e:
        return _reject(v, "gpu", str(e)), None, None
    v["gpu"] = target.name
    cfg, field, reason = check_config(config, target)
    if cfg is None:
        return _reject(v, field, reason), None, None
    v["config"] = cfg
    from schedule.lower import lower, schedule_id
    v["schedule_id"] = schedule_id(cfg)
    # 4. model, 5. lowering
    dtype = dtype or _default_dtype(str(model_id))
    try:
        graph = _graph(model_id, dtype, seed)
    except GraphError as e:
        return _reject(v, "model", str(e)), None, None
    v["dtype"] = graph.dtype
    if max_seq is None and ctx >= min(graph.config.max_position, 4096):   # decode at position ctx needs ctx + 1
        max_seq = min(ctx + 1, graph.config.max_position)
    try:
        prog = lower(graph, target, cfg, max_seq=max_seq)
    except IRError as e:
        return _reject(v, next((k for k in cfg if str(e).startswith(k)), "config"), str(e)), None, graph
    if ctx >= prog.meta["max_seq"]:   # the step at position ctx must fit in the KV cache
        v["notes"].append(f"ctx {ctx} clamped to {prog.meta['max_seq'] - 1} (KV-cache capacity "
                          f"{prog.meta['max_seq']} positions)")
        ctx = v["ctx"] = int(prog.meta["max_seq"]) - 1
    st = prog.stats()
    v.update(tasks=st["tasks"], sms=st["sms"], weight_mb=round(prog.weight_bytes / 1e6, 3))
    # 6. shared memory
    smem = smem_required(prog)
    v["smem_bytes"] = smem
    if smem > target.smem_per_block:
        return _reject(v, "smem_per_block", f"shared memory: the program needs {smem} B per block "
                       f"(4 B x the largest GEMV input length + {SMEM_SCRATCH_BYTES} B scratch) but "
                       f"{target.name}.smem_per_block is {target.smem_per_block} B"), None, graph
    # 7. validator
    res = validate(prog)
    if not res.ok:
        errs = res.errors[:MAX_ERRORS_REPORTED]
        return _reject(v, "program", f"validator rejected the program ({len(res.errors)} error(s)): "
                       + " | ".join(errs)), None, graph
    v["valid"], v["status"] = True, "UNVERIFIED"
    # 8. roofline + cost model
    from eval.roofline import pct_of_roofline, roofline
    from schedule.cost_model import predict_us
    bound = roofline(prog, target, ctx=ctx)["floor_us"]
    v["bound_us"] = bound
    try:
        v["predicted_us"] = float(predict_us(prog, target, ctx=ctx))
    except ValueError as e:
        v["notes"].append(f"cost model: {e}")
    # 9. correctness, then latency
    latency, kind = None, None
    if on_gpu:
        from eval.bench import measure_program   # lazy: only with a GPU
        live = _live_gpu_name()
        if live is not None and live != target.name:
            v["notes"].append(f"lowered for {target.name} but measured on a {live}")
        kw = {"check_steps": max(1, int(verify_steps or 0)), **(bench_kwargs or {})}
        m = measure_program(prog, graph, ctx=ctx, **kw)
        v.update(correct=bool(m.get("correct")), verify_steps=kw["check_steps"], max_abs_err=m.get("max_abs_err"), max_rel_err=m.get("max_rel_err"),
                 top1_agreement=m.get("top1_agreement"))
        if m.get("note"):
            v["notes"].append(str(m["note"]))
        if v["correct"]:
            latency, kind = m.get("latency_us"), m.get("latency_kind") or "measured-gpu"
    else:
        n_params = _param_count(graph)
        if verify_steps and verify_steps > 0 and n_params <= CPU_VERIFY_MAX_PARAMS:
            _cpu_correctness(v, model_id, graph, prog, verify_steps, seed)
        elif verify_steps and verify_steps > 0:
            v["notes"].append(f"correctness not checked on CPU: {n_params / 1e6:.0f}M params > "
                              f"{CPU_VERIFY_MAX_PARAMS / 1e6:.0f}M (run on a GPU for a checked verdict)")
        else:
            v["notes"].append("correctness not checked (verify_steps=0)")
        if v["correct"] is not False and v["predicted_us"] is not None:
            latency, kind = v["predicted_us"], "predicted"
    v["status"] = {True: "PASS", False: "FAIL", None: "UNVERIFIED"}[v["correct"]]
    if v["correct"] is False:
        v["notes"].append("no latency: correctness FAILED")
    elif latency is not None and latency < bound:
        v["notes"].append(f"latency withheld: {latency:.3f} us is below the roofline floor {bound:.3f} us "
                          "(a measurement artifact, not a result)")
        latency, kind = None, None
    if latency is not None:
        v.update(latency_us=float(latency), latency_kind=kind, pct_of_roofline=pct_of_roofline(latency, bound))
    v["seconds"] = round(time.perf_counter() - t0, 3)
    return v, prog, graph


def _safe_evaluate(model_id, gpu, config, device="auto", ctx=512, verify_steps=4, seed=0, dtype=None,
                   max_seq=None, bench_kwargs=None) -> tuple[dict, Any, Any]:
    try:
        return _evaluate(model_id, gpu, config, device, ctx, verify_steps, seed, dtype, max_seq, bench_kwargs)
    except Exception as e:   # an internal failure is reported, not raised, so an agent's loop survives it
        v = _blank(model_id, gpu, config, device, ctx)
        v.update(status="ERROR", rejected_field="internal", rejected_reason=f"internal error: {type(e).__name__}: {e}")
        return v, None, None


def evaluate(model_id: str, gpu, config: Any, device: str = "auto", ctx: int = 512, verify_steps: int = 4,
             seed: int = 0, dtype: str | None = None, max_seq: int | None = None,
             bench_kwargs: dict | None = None) -> dict:
    """Judge one ScheduleConfig for ``model_id`` on ``gpu``. Returns a Verdict dict (see HARNESS.md); never raises
    for a bad config, model, GPU or device -- those come back as ``valid=False`` with ``rejected_field``."""
    return _safe_evaluate(model_id, gpu, config, device, ctx, verify_steps, seed, dtype, max_seq, bench_kwargs)[0]


# -- propose -------------------------------------------------------------------------------------------------
def propose(model_id: str, gpu, incumbent: dict | None = None, log_dir: str = "runs", n_suggestions: int = 3,
            seed: int = 0) -> dict:
    """The starting point for a search: ``incumbent`` if given, else the best corpus point for this model + GPU,
    else the defaults; plus a few 1-2 knob neighbours to try and the whole search space. Raises IRError /
    GraphError for an unknown GPU / model or a malformed incumbent (the CLI prints them as one line)."""
    from schedule.ir import IRError
    from schedule.lower import schedule_id
    target = _target(gpu)
    _check_model_name(model_id)
    source, rec = "defaults", None
    if incumbent is not None:
        cfg, field, reason = check_config(incumbent, target)
        if cfg is None:
            raise IRError(f"incumbent: {reason}")
        source = "incumbent"
    else:
        rec = prior.best_corpus_point(str(model_id), target.name, str(flog.corpus_path(log_dir)))
        cfg = {**prior.defaults(), **rec["config"]} if rec else prior.defaults()
        source = "corpus" if rec else "defaults"
    rng = random.Random(seed)
    seen, sugg = {schedule_id(cfg)}, []
    for _ in range(50 * n_suggestions):
        if len(sugg) >= n_suggestions:
            break
        c, changed = prior.mutate(cfg, rng, target)
        sid = schedule_id(c)
        if changed and sid not in seen and check_config(c, target)[0] is not None:
            seen.add(sid)
            sugg.append({"config": c, "schedule_id": sid, "changed": changed})
    out = {"model": str(model_id), "gpu": target.name, "source": source, "config": cfg,
           "schedule_id": schedule_id(cfg), "suggestions": sugg, "search_space": search_space()}
    if rec:
        out["corpus_verdict"] = {k: rec["verdict"].get(k) for k in ("latency_us", "latency_kind", "correct", "tasks")}
    return out


# -- loop ----------------------------------------------------------------------------------------------------
def _acceptable(v: dict, allow_unverified: bool) -> bool:
    return bool(v.get("valid")) and v.get("latency_us") is not None and (
        v.get("correct") is True or (allow_unverified and v.get("correct") is None))


def loop(model_id: str, gpu, budget: int, device: str = "auto", seed: int = 0, log_dir: str = "runs",
         ctx: int = 512, verify_steps: int = 4, dtype: str | None = None, incumbent: dict | None = None,
         explore_frac: float = 1 / 3, min_gain: float = 0.01, ab_rounds: int = 5, allow_unverified: bool = False,
         progress: bool = True, plot: bool = True, tag: str | None = None) -> dict:
    """Keep/revert search over ``budget`` evaluations (the incumbent's included).

    Trial 0 is the incumbent (``incumbent``, else the best corpus point, else defaults); the next
    ``explore_frac`` of the budget samples random configs, the rest mutates 1-2 knobs of the best. A candidate is
    kept only if correct and >= ``min_gain`` faster, or not slower with fewer tasks; on a GPU a would-be winner must
    also win an interleaved A/B (``eval.bench.ab_compare``) against the incumbent's program. Every trial goes to
    results.tsv, every kept point to corpus.jsonl.
    """
    from schedule.ir import IRError
    from schedule.lower import schedule_id
    if not isinstance(budget, int) or budget < 1:
        raise IRError(f"budget: expected an integer >= 1, got {budget!r}")
    target = _target(gpu)
    rng = random.Random(seed)
    tag = tag or f"loop-{time.strftime('%Y%m%d-%H%M%S')}-s{seed}-p{os.getpid()}"
    start, source = None, "defaults"
    if incumbent is not None:
        start, _, reason = check_config(incumbent, target)
        if start is None:
            raise IRError(f"incumbent: {reason}")
        source = "incumbent"
    if start is None:
        rec = prior.best_corpus_point(str(model_id), target.name, str(flog.corpus_path(log_dir)))
        start, source = ({**prior.defaults(), **rec["config"]}, "corpus") if rec else (prior.defaults(), "defaults")
    n_explore = int(round(budget * explore_frac)) if budget > 2 else 0
    best_v = best_cfg = best_prog = None
    trials, seen, t0 = [], set(), time.perf_counter()
    flog.progress_bar(0, budget, None, t0, progress)
    for i in range(budget):
        changed: list[str] = []
        if i == 0:
            kind, cfg = source, start
        else:
            kind = "explore" if i <= n_explore else "mutate"
            for _ in range(200):   # skip configs already tried
                if kind == "explore" or best_cfg is None:
                    cfg, changed = prior.random_config(rng, target), ["random"]
                else:
                    cfg, changed = prior.mutate(best_cfg, rng, target)
                if schedule_id(cfg) not in seen:
                    break
        seen.add(schedule_id(cfg))
        v, prog, graph = _safe_evaluate(model_id, target, cfg, device, ctx, verify_steps, seed, dtype)
        kept, why, ab = False, "", None
        if _acceptable(v, allow_unverified):
            if best_v is None:
                kept, why = True, "first acceptable point"
            else:
                gain = best_v["latency_us"] / v["latency_us"] - 1.0
                simpler = v["latency_us"] <= best_v["latency_us"] and v["tasks"] < best_v["tasks"]
                if gain >= min_gain or simpler:
                    kept, why = True, (f"{gain:+.1%} faster" if gain >= min_gain else
                                       f"not slower ({gain:+.1%}) and simpler ({v['tasks']} < {best_v['tasks']} tasks)")
                    if v["latency_kind"] == "measured-gpu" and best_prog is not None and prog is not None:
                        from eval.bench import ab_compare   # lazy: GPU only
                        try:
                            ab = ab_compare(best_prog, prog, graph, ctx=v["ctx"], rounds=ab_rounds)
                            sp = float(ab["a_us"]) / float(ab["b_us"]) if ab.get("b_us") else 0.0
                        except Exception as e:   # an A/B that cannot run confirms nothing
                            ab, sp = {"error": f"{type(e).__name__}: {e}"}, 0.0
                        need = 1.0 + min_gain if gain >= min_gain else 1.0
                        if sp < need:
                            kept, why = False, f"A/B did not confirm: speedup {sp:.3f} < {need:.3f}"
                        else:
                            why += f"; A/B confirmed {sp:.3f}x"
                else:
                    why = f"{gain:+.1%} vs best"
        else:
            why = v.get("rejected_reason") or f"status {v.get('status')}"
        if kept:
            best_v, best_cfg, best_prog = v, v["config"], prog
        trial = {"trial": i, "kind": kind, "changed": changed, "config": v["config"], "verdict": v, "kept": kept,
                 "why": why, "ab": ab, "best_us": best_v["latency_us"] if best_v else None}
        trials.append(trial)
        desc = f"{kind}{(': ' + ', '.join(changed)) if changed else ''} | {'keep' if kept else 'discard'}: {why}"
        flog.append_result(log_dir, flog.trial_row(v, tag, desc))
        if kept and not (i == 0 and source == "corpus"):
            flog.append_corpus(log_dir, str(model_id), target.name, v["config"], v, tag)
        flog.progress_bar(i + 1, budget, best_v, t0, progress)
    out = {"tag": tag, "best_verdict": best_v, "best_config": best_cfg, "trials": trials,
           "results_tsv": str(flog.results_path(log_dir)), "corpus": str(flog.corpus_path(log_dir)), "plot": None,
           "notes": []}
    if plot:
        png = pathlib.Path(log_dir) / f"{tag}.png"
        note = flog.plot_trials(trials, png, f"{model_id} on {target.name}: {tag}")
        out["plot"] = None if note else str(png)
        if note:
            out["notes"].append(note)
    return out


# -- CLI (flywheel/cli.py) ----------------------------------------------------------------------------------
def add_cli(subparsers) -> None:
    """Register ``propose``, ``evaluate`` and ``loop`` on the ``amk`` parser's subparsers (flywheel/cli.py)."""
    from flywheel.cli import add_cli as add
    add(subparsers)


def main_cli(argv: list[str] | None = None) -> int:
    """Run ``propose`` / ``evaluate`` / ``loop`` stand-alone with the ``amk`` conventions (errors: one line, exit 2)."""
    from flywheel.cli import main_cli as run
    return run(argv)

if __name__ == "__main__":
    sys.exit(main_cli())
