"""The `amk` command line: compile / generate / validate (and bench / propose / evaluate / loop for agents).

    amk compile MODEL --gpu h100 [--config cfg.json] [--out program.json] [--dtype bf16] [--no-verify] [--json]
    amk generate MODEL --prompt-ids 1,2,3 --max-tokens N [--device cpu|cuda] [--json]
    amk validate program.json [--json]

MODEL is a preset (toy, llama-3.2-1b, ...) or a Hugging Face checkpoint directory. Errors are one line on stderr
(`amk: error: ...`) with a non-zero exit and nothing written; `--out` files are written atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

EXIT_OK, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _user_errors():
    from schedule.graph import GraphError
    from schedule.ir import IRError
    from vm.reference_vm import VMError
    return (CLIError, GraphError, IRError, VMError, OSError, json.JSONDecodeError)


def _atomic_write(path: str, text: str) -> None:
    p = pathlib.Path(path)
    if not p.parent.exists():
        raise CLIError(f"--out: directory {str(p.parent)!r} does not exist")
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, p)


def _load_config(path: str | None):
    from schedule.ir import IRError, ScheduleConfig
    if not path:
        return ScheduleConfig()
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise CLIError(f"--config: cannot read {path!r}: {e.strerror}") from None
    try:
        return ScheduleConfig.from_json(text)
    except IRError as e:
        raise CLIError(f"--config {path}: {e}") from None


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def _emit(args, report: dict, lines: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(lines))


# --------------------------------------------------------------------------------------------------------------
def cmd_compile(args) -> int:
    import torch
    from eval.equivalence import describe_failures, verify_steps
    from eval.roofline import roofline
    from schedule.cost_model import predict_us
    from schedule.graph import load_model
    from schedule.ir import get_target, validate
    from schedule.lower import lower
    from vm.reference_vm import ReferenceVM

    target = get_target(args.gpu)
    cfg = _load_config(args.config)
    t0 = time.perf_counter()
    graph = load_model(args.model, dtype=args.dtype, seed=args.seed)
    prog = lower(graph, target, cfg, max_seq=args.max_seq)
    t_lower = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = validate(prog)
    t_val = time.perf_counter() - t1
    rl = roofline(prog, target, ctx=args.ctx)
    st = prog.stats()
    report = {"model": graph.name, "arch": graph.config.arch, "gpu": target.name, "dtype": graph.dtype,
              "schedule_id": prog.meta["schedule_id"], "tasks": st["tasks"], "counters": st["counters"],
              "sms": st["sms"], "ops": st["ops"], "weight_bytes": prog.weight_bytes,
              "weight_mb": round(prog.weight_bytes / 1e6, 1), "roofline": rl, "lower_seconds": round(t_lower, 2),
              "validate_seconds": round(t_val, 2), "valid": res.ok, "errors": res.errors[:20]}
    lines = [f"model        {graph.name} ({graph.config.arch}, {graph.config.n_layers} layers, {graph.dtype})",
             f"target       {target.name}: {target.sm_count} SMs, {target.hbm_gbps:.0f} GB/s",
             f"program      {st['tasks']} tasks, {st['counters']} counters, {st['sms']} SM queues  "
             f"[{', '.join(f'{k} {v}' for k, v in st['ops'].items())}]",
             f"weights      {prog.weight_bytes / 1e9:.3f} GB ({prog.weight_bytes:,} bytes)",
             f"roofline     {rl['floor_us']:.1f} us/token at ctx {args.ctx} "
             f"(weights + {rl['kv_bytes'] / 1e6:.1f} MB KV over {rl['bandwidth_gbps']:.0f} GB/s)",
             f"time         lower {t_lower:.2f} s, validate {t_val:.2f} s"]
    if not res.ok:
        report["verdict"] = "REJECTED"
        lines += ["verdict      REJECTED", res.report()]
        _emit(args, report, lines)
        return EXIT_REJECTED
    verdict = "VALID"
    if not args.no_verify:
        t2 = time.perf_counter()
        rng = torch.Generator().manual_seed(args.seed + 1)
        toks = torch.randint(0, graph.config.vocab, (args.verify_steps,), generator=rng).tolist()
        vm = ReferenceVM(prog, graph.weights, seed=args.seed, check=False)
        model = graph.hf_model(dtype="f32", weights=vm.weight_tensors() if vm.upcast else None)
        ver = verify_steps(vm.step, model, toks, graph.dtype)
        del model
        ver["seconds"] = round(time.perf_counter() - t2, 1)
        report["verify"] = ver
        verdict = "PASS" if ver["passed"] and ver["top1_agreement"] == 1.0 else "FAIL"
        why = describe_failures(ver)
        lines.append(f"verify       reference VM vs transformers eager (fp32), {ver['steps']} steps: "
                     f"max rel err {ver['max_rel_err']:.2e}, top-1 {ver['top1_agreement']:.0%} "
                     f"-> {verdict} ({ver['seconds']} s)" + (f"; {why}" if why else ""))
    if _has_gpu() and not args.no_gpu:
        from eval.bench import measure_program
        m = measure_program(prog, graph, ctx=args.ctx)
        report.update({"latency_us": m["latency_us"], "latency_kind": m["latency_kind"],
                       "gpu_check": m})
        lines.append(f"latency      {m['latency_us']} us/token ({m['latency_kind']}); {m.get('note', '')}")
    else:
        pred = predict_us(prog, target, ctx=args.ctx)
        report.update({"latency_us": round(pred, 1), "latency_kind": "predicted"})
        lines.append(f"latency      {pred:.1f} us/token (predicted by the cost model: no GPU on this machine)")
    report["verdict"] = verdict
    lines.append(f"verdict      {verdict}")
    if args.out:
        _atomic_write(args.out, prog.to_json())
        lines.append(f"wrote        {args.out}")
    _emit(args, report, lines)
    return EXIT_OK if verdict in ("PASS", "VALID") else EXIT_REJECTED


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise CLIError(f"--prompt-ids: expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise CLIError("--prompt-ids: empty prompt")
    return ids


def _tokenizer(model: str):
    """The checkpoint's tokenizer.json (via the `tokenizers` library), or a CLIError."""
    path = pathlib.Path(model) / "tokenizer.json"
    if not path.is_file():
        raise CLIError(f"--prompt needs a tokenizer: {model!r} has no tokenizer.json (use --prompt-ids)")
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise CLIError(f"{path}: cannot load tokenizer ({type(e).__name__}: {e})") from None


def cmd_generate(args) -> int:
    from eval.equivalence import greedy_decode, hf_greedy
    from schedule.graph import load_model
    from schedule.ir import TARGETS, get_target
    from schedule.lower import lower
    if (args.prompt is None) == (args.prompt_ids is None):
        raise CLIError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    tok = _tokenizer(args.model) if args.prompt is not None else None
    if args.device == "auto":
        args.device = "cuda" if _has_gpu() else "cpu"
    if args.device != "cpu" and not _has_gpu():
        raise CLIError("--device cuda: no CUDA GPU is available on this machine (use --device cpu)")
    # preset weights are generated where they will run (1B parameters take minutes on a CPU)
    graph = load_model(args.model, dtype=args.dtype, seed=args.seed,
                       **({"device": "cuda"} if args.device != "cpu" else {}))
    prompt = tok.encode(args.prompt).ids if tok else _parse_ids(args.prompt_ids)
    if not prompt:
        raise CLIError("--prompt encodes to no tokens")
    V = graph.config.vocab
    bad = [t for t in prompt if not 0 <= t < V]
    if bad:
        raise CLIError(f"--prompt-ids: token id {bad[0]} outside the vocabulary [0, {V})")
    if args.max_tokens < 1:
        raise CLIError("--max-tokens must be >= 1")
    need = len(prompt) + args.max_tokens
    if need > graph.config.max_position:
        raise CLIError(f"prompt + max-tokens = {need} exceeds the model's context {graph.config.max_position}")
    cfg = _load_config(args.config)
    # a multi-step program's launch also runs the steps after its position: the cache holds the last launch's
    per = int(cfg.steps_per_launch)
    if need + per - 1 > graph.config.max_position:
        raise CLIError(f"prompt + max-tokens = {need}, plus {per - 1} positions for launches of steps_per_launch "
                       f"{per}, exceeds the model's context {graph.config.max_position}")
    need += per - 1
    t0 = time.perf_counter()
    if args.device == "cpu":
        from vm.reference_vm import ReferenceVM
        prog = lower(graph, TARGETS[args.gpu] if args.gpu in TARGETS else TARGETS["h100"], cfg, max_seq=need)
        vm = ReferenceVM(prog, graph.weights, seed=args.seed)
        tokens = greedy_decode(vm.step, prompt, args.max_tokens)
    else:
        from eval.generate import gpu_generate
        from eval.roofline import pct_of_roofline, roofline
        from vm import jit
        from vm.loader import MegakernelVM
        prog = lower(graph, get_target(args.gpu), cfg, max_seq=need)
        vm = MegakernelVM(prog, graph.weights)
        b = dict(jit.LAST_BUILD)
        build = (f"built the megakernel in {b.get('build_s', 0):.1f} s" if b.get("built")
                 else f"reused the cached megakernel build ({b.get('load_s', 0):.2f} s load)")
        if not args.json:
            print(f"[{build}]", file=sys.stderr)

        def stream(new):
            if not args.json:
                print(tok.decode(new) if tok else " ".join(str(t) for t in new), end="" if tok else " ", flush=True)
        st = gpu_generate(vm, prompt, args.max_tokens, on_chunk=stream)
        if not args.json:
            print()
        tokens = st.pop("tokens")
        rl = roofline(prog, ctx=len(prompt) + args.max_tokens // 2)
        # significant figures, not fixed decimals: a tiny model's floor is a fraction of a microsecond and its
        # share of the roofline well under 0.1% (a fixed 0.1 rounding reported 0.0 for both)
        st.update({"build": build, "floor_us": float(f"{rl['floor_us']:.4g}"),
                   "pct_of_roofline": float(f"{pct_of_roofline(st['decode_us_per_token'], rl['floor_us']):.4g}")})
        gpu_stats = st
    dt = time.perf_counter() - t0
    out = {"tokens": tokens, "seconds": round(dt, 3), "device": args.device}
    if args.device != "cpu":
        out["gpu"] = gpu_stats
    if args.verify:
        hf_dev = "cuda" if args.device != "cpu" else "cpu"
        ref = hf_greedy(graph.hf_model(device=hf_dev), prompt, args.max_tokens)
        first = next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), None)
        out["verify"] = {"hf_tokens": ref, "identical": ref == tokens, "first_difference": first}
    if tok:
        out["text"] = tok.decode(tokens)
    if args.json:
        print(json.dumps(out))
    else:
        if args.device == "cpu":   # the GPU path streamed its text chunk by chunk already
            print(out["text"] if tok else " ".join(str(t) for t in tokens))
        print(f"[{len(tokens)} tokens in {dt:.2f} s on {args.device}]", file=sys.stderr)
        if args.device != "cpu":
            s = out["gpu"]
            print(f"[decode {s['decode_us_per_token']} us/token, {s['tokens_per_s']} tokens/s, "
                  f"{s['pct_of_roofline']}% of the {s['floor_us']} us roofline; prefill {s['prefill_tokens']} "
                  f"tokens token-by-token in {s['prefill_s']:.2f} s; sync check {s['sync_check']}]", file=sys.stderr)
        if args.verify:
            v = out["verify"]
            print("[verify vs transformers greedy: " + ("identical" if v["identical"] else
                  f"DIFFERENT from generated token {v['first_difference']} "
                  "(scripts/greedy_divergence.py prints both logits there)") + "]", file=sys.stderr)
    return EXIT_OK if not args.verify or out["verify"]["identical"] else EXIT_REJECTED


def cmd_validate(args) -> int:
    from schedule.ir import IRError, MegakernelProgram, validate
    try:
        text = pathlib.Path(args.program).read_text()
    except OSError as e:
        raise CLIError(f"cannot read {args.program!r}: {e.strerror}") from None
    try:
        prog = MegakernelProgram.from_json(text)
    except IRError as e:
        raise CLIError(f"{args.program}: {e}") from None
    res = validate(prog)
    if args.json:
        print(json.dumps({"ok": res.ok, "errors": res.errors, "warnings": res.warnings, "stats": res.stats},
                         default=str))
    else:
        print(res.report())
    return EXIT_OK if res.ok else EXIT_REJECTED


def cmd_bench(args) -> int:
    if not _has_gpu():
        raise CLIError("amk bench needs a CUDA GPU (none is available on this machine)")
    from eval.bench import format_table, run_bench
    cfg = _load_config(args.config)
    res = run_bench(args.model, args.gpu, args.ctx, cfg, args.dtype or "bf16",
                    None if args.compile_mode == "none" else args.compile_mode, args.iters, args.steps_per_launch)
    if args.out:
        _atomic_write(args.out, json.dumps(res, indent=2, default=str))
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(format_table(res))
    multi = res.get("amk_multistep")
    return EXIT_OK if res["amk"]["correct"] and (multi is None or multi["correct"]) else EXIT_REJECTED


# --------------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        print(f"amk: error: {message}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="amk", description="AMK: persistent CUDA megakernel VM for LLM decode")
    sub = p.add_subparsers(dest="cmd", parser_class=_Parser)
    sub.required = True
    c = sub.add_parser("compile", help="import, lower, validate, verify, report")
    c.add_argument("model")
    c.add_argument("--gpu", default="h100", help="target GPU name (h100, h200, a100, ...) or 'auto'")
    c.add_argument("--config", help="ScheduleConfig JSON file")
    c.add_argument("--out", help="write the program JSON here")
    c.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None,
                   help="weight dtype (presets default to bf16 ... f32 for toy; checkpoints keep theirs)")
    c.add_argument("--max-seq", type=int, default=None, help="KV-cache capacity in tokens")
    c.add_argument("--ctx", type=int, default=512, help="context length for the roofline/latency")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--verify-steps", type=int, default=8)
    c.add_argument("--no-verify", action="store_true", help="skip the CPU check against transformers")
    c.add_argument("--no-gpu", action="store_true", help="do not build/measure on a local GPU")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_compile)
    g = sub.add_parser("generate", help="greedy decode with a persistent KV cache")
    g.add_argument("model")
    g.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json in the checkpoint directory)")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="cuda: the megakernel; cpu: the reference VM; auto (default): cuda when a GPU is present")
    g.add_argument("--gpu", default="h100")
    g.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None)
    g.add_argument("--config")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--verify", action="store_true", help="compare with transformers greedy generate")
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)
    v = sub.add_parser("validate", help="validate a program JSON (exit 0 valid, 1 rejected, 2 unreadable)")
    v.add_argument("program")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_validate)
    b = sub.add_parser("bench", help="AMK vs torch eager / CUDA graph / torch.compile on the live GPU")
    b.add_argument("model")
    b.add_argument("--gpu", default="auto")
    b.add_argument("--ctx", type=int, default=512)
    b.add_argument("--config")
    b.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None)
    b.add_argument("--compile-mode", default="max-autotune-no-cudagraphs", help="torch.compile mode, or 'none'")
    b.add_argument("--iters", type=int, default=50)
    b.add_argument("--steps-per-launch", type=int, default=8,
                   help="also time the program as this many greedy steps per launch (knob steps_per_launch; "
                        "1 = no such row)")
    b.add_argument("--out", help="write the JSON record here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(fn=cmd_bench)
    try:
        import harness
        if hasattr(harness, "add_cli"):
            harness.add_cli(sub)
    except ImportError:
        pass
    return p


def _default_dtype(args) -> None:
    if getattr(args, "dtype", "x") is None:
        from schedule.graph import PRESETS
        m = getattr(args, "model", "")
        args.dtype = ("f32" if m == "toy" else "bf16") if m in PRESETS else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _default_dtype(args)
    try:
        return args.fn(args)
    except _user_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"amk: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("amk: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
