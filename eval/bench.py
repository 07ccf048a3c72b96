"""Correctness-gated GPU timing of AMK programs and the peer benchmark behind `amk bench`.

* ``measure_program``: build the megakernel VM, check it against transformers eager (fp32 on the GPU, same weights)
  for a few steps, and only then time decode steps at context ``ctx`` with CUDA events (warm-up, median of repeats,
  token ids rotated every step). A latency under the roofline floor is withheld as an artifact.
* ``ab_compare``: interleaved A/B timing of two programs (A, B, A, B, ...) to confirm a search winner.
* ``run_bench``: one process, one GPU, same preset and weights: AMK vs torch eager vs the same torch step as one
  CUDA graph vs torch.compile + CUDA graph, plus measured HBM read/copy bandwidth; a table and a JSON record.
"""
from __future__ import annotations

import datetime
import statistics

import torch

from eval.baselines import cuda_time_us, hbm_bandwidth, torch_baselines
from eval.equivalence import compare_logits, describe_failures, hf_logits, summarize
from eval.roofline import pct_of_roofline, roofline


BENCH_SEQ_PAD = 64   # cache positions a bench program holds beyond its context


def bench_max_seq(ctx: int) -> int:
    """The KV-cache capacity a bench at context ``ctx`` lowers its program with (the auto split count follows it)."""
    return ctx + BENCH_SEQ_PAD


def check_tokens(vocab: int, n: int, seed: int) -> list[int]:
    """The ``n`` given tokens the correctness check (check_program via reference_logits) feeds, for ``seed``."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_REF_CACHE: dict = {}


def reference_logits(graph, steps: int = 4, seed: int = 0, tokens: list[int] | None = None
                     ) -> tuple[list[int], torch.Tensor]:
    """(tokens, transformers eager fp32 logits [steps, vocab]) for this graph, cached per process. ``tokens``: these
    instead of ``steps`` random ones."""
    key = (id(graph), steps, seed) if tokens is None else (id(graph), tuple(tokens))
    if key not in _REF_CACHE:
        toks = check_tokens(graph.config.vocab, steps, seed) if tokens is None else list(tokens)
        model = graph.hf_model(dtype="f32", device="cuda")
        _REF_CACHE[key] = (toks, hf_logits(model, toks))
        del model
        torch.cuda.empty_cache()
    return _REF_CACHE[key]


def check_program(vm, graph, steps: int = 4, seed: int = 0) -> dict:
    """Compare the GPU VM's logits with transformers eager (fp32, same weights) for ``steps`` decode steps. A
    multi-step program (vm.n_steps > 1) is also checked on the greedy steps its last launch ran after the given
    token: their logits against transformers on the given tokens followed by the VM's own greedy ones."""
    toks, ref = reference_logits(graph, steps, seed)
    vm.reset()
    rows = [compare_logits(vm.step(t, i).float().cpu(), ref[i], graph.dtype) for i, t in enumerate(toks)]
    labels = [f"step {i}" for i in range(len(toks))]
    n = int(getattr(vm, "n_steps", 1))
    if n > 1:
        follow = vm.tokens_all[:n - 1].tolist()
        got = [lg.float().cpu() for lg in vm.step_logits[1:]]
        _, ref2 = reference_logits(graph, tokens=toks + follow)
        rows += [compare_logits(got[s], ref2[len(toks) + s], graph.dtype) for s in range(n - 1)]
        labels += [f"step {s + 1} of the last launch (position {len(toks) + s})" for s in range(n - 1)]
    vm.reset()
    s = summarize(rows, labels)
    s["correct"] = bool(s["passed"] and s["top1_agreement"] == 1.0)
    return s


def time_vm(vm, vocab: int, ctx: int, iters: int = 50, repeats: int = 7, warmup: int = 5) -> dict:
    """us/token of decode steps at position ``ctx`` (KV bytes of ctx positions are read), token ids rotating. A
    multi-step program's launch (steps at ctx .. ctx + n_steps - 1) counts as n_steps tokens."""
    toks = torch.randint(0, vocab, (iters,), generator=torch.Generator().manual_seed(1)).tolist()
    i = [0]
    n = int(getattr(vm, "n_steps", 1))

    def one():
        vm.step(toks[i[0] % iters], ctx, check=False)
        i[0] += 1
    r = cuda_time_us(one, iters=iters, repeats=repeats, warmup=warmup)
    vm.check_status()
    if n > 1:
        r = {**r, "us": r["us"] / n, "min_us": r["min_us"] / n, "max_us": r["max_us"] / n,
             "repeats": [x / n for x in r["repeats"]], "steps_per_launch": n}
    return r


def floors(program, ctx: int, bandwidth: dict | None = None) -> tuple[float, float]:
    """(report_us, withhold_us) for one token at context ``ctx``. report: the floor a latency's % of roofline is
    taken against -- the program's bytes over the measured copy bandwidth where ``bandwidth`` (hbm_bandwidth()'s
    dict) is given, as in the bench table, else over the target's nominal bandwidth. withhold: the lowest floor any
    of those bandwidths (nominal, measured read, measured copy) gives; a latency under it is withheld."""
    nominal = roofline(program, ctx=ctx)["floor_us"]
    if not bandwidth:
        return nominal, nominal
    copy = roofline(program, ctx=ctx, bandwidth_gbps=bandwidth["copy_gbps"])["floor_us"]
    read = roofline(program, ctx=ctx, bandwidth_gbps=bandwidth["read_gbps"])["floor_us"]
    return copy, min(nominal, copy, read)


def measure_program(program, graph, ctx: int = 512, iters: int = 50, repeats: int = 7, check_steps: int = 4,
                    vm=None, bandwidth: dict | None = None) -> dict:
    """{correct, max_abs_err, max_rel_err, top1_agreement, latency_us (None unless correct), latency_kind, ...}.
    bound_us / pct_of_roofline: against ``floors(program, ctx, bandwidth)``'s report floor."""
    from vm.loader import MegakernelVM
    if ctx >= int(program.meta["max_seq"]):
        raise ValueError(f"ctx {ctx} must be below the program's max_seq {program.meta['max_seq']}")
    vm = vm or MegakernelVM(program, graph.weights)
    chk = check_program(vm, graph, check_steps)
    floor_us, withhold_us = floors(program, ctx, bandwidth)
    out = {"correct": chk["correct"], "max_abs_err": chk["max_abs_err"], "max_rel_err": chk["max_rel_err"],
           "top1_agreement": chk["top1_agreement"], "latency_us": None, "latency_kind": None,
           "bound_us": floor_us, "pct_of_roofline": None, "note": ""}
    if not chk["correct"]:
        why = describe_failures(chk)
        out["note"] = "not timed: the GPU program does not match transformers" + (f" ({why})" if why else "")
        return out
    t = time_vm(vm, graph.config.vocab, ctx, iters, repeats)
    if t["us"] < withhold_us:
        out["note"] = f"latency {t['us']:.1f} us is below the roofline floor {withhold_us:.1f} us: withheld"
        return out
    out.update({"latency_us": round(t["us"], 2), "latency_kind": "measured-gpu", "spread_us": [t["min_us"], t["max_us"]],
                "pct_of_roofline": round(pct_of_roofline(t["us"], floor_us), 1),
                "note": f"median of {repeats} x {iters} steps at ctx {ctx}"})
    return out


def ab_compare(prog_a, prog_b, graph, ctx: int = 512, rounds: int = 6, iters: int = 30) -> dict:
    """Interleaved A/B timing: alternate A and B rounds so drift (clocks, thermals) hits both equally."""
    from vm.loader import MegakernelVM
    va, vb = MegakernelVM(prog_a, graph.weights), MegakernelVM(prog_b, graph.weights)
    a, b = [], []
    for _ in range(rounds):
        a.append(time_vm(va, graph.config.vocab, ctx, iters, repeats=1, warmup=2)["us"])
        b.append(time_vm(vb, graph.config.vocab, ctx, iters, repeats=1, warmup=2)["us"])
    ma, mb = statistics.median(a), statistics.median(b)
    return {"a_us": ma, "b_us": mb, "speedup": ma / mb, "a_rounds": a, "b_rounds": b}


def run_bench(model: str, gpu: str = "auto", ctx: int = 512, config=None, dtype: str = "bf16",
              compile_mode: str | None = "max-autotune-no-cudagraphs", iters: int = 50,
              steps_per_launch: int = 8) -> dict:
    """The peer table for one model on the live GPU. Returns a JSON-able dict with a 'rows' list.
    steps_per_launch > 1 (and a config of one step per launch) adds a row for the same program run as
    ``steps_per_launch`` greedy steps per launch (knob steps_per_launch; its own correctness gate, every step
    checked), under the key 'amk_multistep'; ratios stay against the one-step row."""
    from schedule.graph import load_model
    from schedule.ir import get_target
    from schedule.lower import lower
    if not torch.cuda.is_available():
        raise RuntimeError("amk bench needs a CUDA GPU")
    target = get_target(gpu)
    graph = load_model(model, dtype=dtype, device="cuda")
    max_seq = bench_max_seq(ctx)
    prog = lower(graph, target, config, max_seq=max_seq)
    bw = hbm_bandwidth()
    amk = measure_program(prog, graph, ctx=ctx, iters=iters, bandwidth=bw)   # its % against the table's floor
    multi = None
    if steps_per_launch > 1 and int(prog.config.get("steps_per_launch", 1)) == 1:
        prog_n = lower(graph, target, {**prog.config, "steps_per_launch": int(steps_per_launch)}, max_seq=max_seq)
        multi = measure_program(prog_n, graph, ctx=ctx, iters=max(4, iters // int(steps_per_launch)), bandwidth=bw)
        multi["steps_per_launch"] = int(steps_per_launch)
        multi["schedule_id"] = prog_n.meta["schedule_id"]
    rl = roofline(prog, ctx=ctx, bandwidth_gbps=bw["copy_gbps"])
    peers = torch_baselines(graph, ctx, max_seq, compile_mode, iters=max(10, iters // 2))
    ref = peers.pop("logits_check")
    rows = [("amk_megakernel", amk["latency_us"])]
    if multi is not None:
        rows.append((f"amk_megakernel_{steps_per_launch}_per_launch", multi["latency_us"]))
    rows += [(k, v) for k, v in peers.items() if k.startswith("torch_")]
    table = []
    for name, us in rows:
        table.append({"name": name, "us_per_token": None if us is None else round(us, 1),
                      "pct_of_roofline": None if us is None else round(pct_of_roofline(us, rl["floor_us"]), 1),
                      "ratio_vs_amk": (None if us is None or amk["latency_us"] is None
                                       else round(us / amk["latency_us"], 3))})
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "model": model, "dtype": dtype, "ctx": ctx, "schedule_id": prog.meta["schedule_id"],
            "config": prog.config, "bandwidth": bw, "roofline": rl, "amk": amk, "amk_multistep": multi, "rows": table,
            "torch_step_top1": int(ref.argmax()), "notes": peers.get("torch_compile_error", "")}


def format_table(res: dict) -> str:
    lines = [f"{res['model']} {res['dtype']} ctx {res['ctx']} on {res['gpu']} ({res['date']}); "
             f"HBM read {res['bandwidth']['read_gbps']:.0f} GB/s, copy {res['bandwidth']['copy_gbps']:.0f} GB/s; "
             f"floor {res['roofline']['floor_us']:.1f} us (bytes / copy bandwidth)",
             f"{'variant':28s} {'us/token':>10s} {'% roofline':>11s} {'x AMK':>7s}"]
    for r in res["rows"]:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        lines.append(f"{r['name']:28s} {f(r['us_per_token'], '10.1f')} {f(r['pct_of_roofline'], '11.1f')} "
                     f"{f(r['ratio_vs_amk'], '7.2f')}")
    a = res["amk"]
    lines.append(f"AMK correctness vs transformers: max rel err {a['max_rel_err']:.2e}, top-1 "
                 f"{a['top1_agreement']:.0%} -> {'PASS' if a['correct'] else 'FAIL'}; {a['note']}")
    m = res.get("amk_multistep")
    if m:
        lines.append(f"AMK, {m['steps_per_launch']} steps per launch (every step checked): max rel err "
                     f"{m['max_rel_err']:.2e}, top-1 {m['top1_agreement']:.0%} -> {'PASS' if m['correct'] else 'FAIL'}; "
                     f"{m['note']} (us per token = us per launch / {m['steps_per_launch']})")
    return "\n".join(lines)
