"""The ``amk propose / evaluate / loop`` subcommands over harness.py's Python surface (``harness.add_cli`` and
``harness.main_cli`` call into here): argument parsing, config input (--config FILE|-, --config-json TEXT), the
human and --json output, exit codes. The search itself -- proposing, the correctness gate, timing, keep/revert --
is harness.py's."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import harness
from flywheel import log as flog


def _read_config_arg(args, default: Any) -> tuple[Any, str | None]:
    """(config, None) from --config FILE|- or --config-json TEXT (``default`` when neither is given), or
    (None, message) when the text is not JSON (evaluate turns that into a REJECTED verdict naming 'config')."""
    from schedule.ir import IRError
    text = args.config_json
    if text is None and args.config:
        try:
            text = sys.stdin.read() if args.config == "-" else pathlib.Path(args.config).read_text()
        except OSError as e:
            raise IRError(f"--config: cannot read {args.config!r}: {e.strerror}") from None
    if text is None:
        return default, None
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"config is not valid JSON: {e}"


def _incumbent_arg(args) -> dict | None:
    from schedule.ir import IRError
    inc, err = _read_config_arg(args, None)
    if err:
        raise IRError(f"incumbent {err}")
    return inc


def _print(args, obj: dict, lines: list[str]) -> None:
    print(json.dumps(obj, indent=2, default=str) if args.json else "\n".join(lines))


def cmd_propose(args) -> int:
    p = harness.propose(args.model, args.gpu, incumbent=_incumbent_arg(args), log_dir=args.log_dir, seed=args.seed)
    lines = [f"incumbent ({p['source']}) {p['schedule_id']}: {json.dumps(p['config'])}"]
    lines += [f"  try {s['schedule_id']}: {', '.join(s['changed'])}" for s in p["suggestions"]]
    _print(args, p, lines)
    return 0


def _verdict_lines(v: dict) -> list[str]:
    if not v["valid"]:
        return [f"REJECTED [{v['rejected_field']}]: {v['rejected_reason']}"]
    lat = f"{v['latency_us']:.2f} us ({v['latency_kind']}, {v['pct_of_roofline']:.1f}% of roofline " \
          f"{v['bound_us']:.2f} us)" if v["latency_us"] is not None else "no latency"
    lines = [f"{v['status']} {v['schedule_id']}: {v['tasks']} tasks on {v['sms']} SMs, {v['weight_mb']} MB weights",
             f"  correct={v['correct']} top1={v['top1_agreement']} max_abs_err={v['max_abs_err']}", f"  {lat}"]
    return lines + [f"  note: {n}" for n in v["notes"]]


def cmd_evaluate(args) -> int:
    cfg, err = _read_config_arg(args, {})
    if err:
        v = harness._reject(harness._blank(args.model, args.gpu, None, args.device, args.ctx), "config", err)
    else:
        v = harness.evaluate(args.model, args.gpu, cfg, device=args.device, ctx=args.ctx,
                             verify_steps=args.verify_steps, seed=args.seed, dtype=args.dtype)
    if args.log_dir:
        flog.append_result(args.log_dir, flog.trial_row(v, args.tag, "amk evaluate"))
        if args.keep and harness._acceptable(v, False):
            flog.append_corpus(args.log_dir, str(args.model), v["gpu"], v["config"], v, args.tag)
    _print(args, v, _verdict_lines(v))
    return 0 if v["valid"] and v["correct"] is not False and v["status"] != "ERROR" else 1


def cmd_loop(args) -> int:
    inc = _incumbent_arg(args)
    r = harness.loop(args.model, args.gpu, args.budget, device=args.device, seed=args.seed, log_dir=args.log_dir,
                     ctx=args.ctx, verify_steps=args.verify_steps, dtype=args.dtype, incumbent=inc,
                     allow_unverified=args.allow_unverified, progress=not args.json, tag=args.tag)
    b = r["best_verdict"]
    lines = [f"best: {json.dumps(r['best_config'])}"] + (_verdict_lines(b) if b else ["no acceptable point"])
    lines += [f"log: {r['results_tsv']}  corpus: {r['corpus']}  plot: {r['plot'] or '-'}"] + r["notes"]
    _print(args, {k: r[k] for k in ("tag", "best_config", "best_verdict", "results_tsv", "corpus", "plot", "notes")}
           | {"trials": [{k: t[k] for k in ("trial", "kind", "changed", "kept", "why")}
                         | {"latency_us": t["verdict"]["latency_us"], "status": t["verdict"]["status"]}
                         for t in r["trials"]]}, lines)
    return 0 if b else 1


def add_cli(subparsers) -> None:
    """Register ``propose``, ``evaluate`` and ``loop`` on the ``amk`` parser's subparsers."""
    def common(p, config_help):
        p.add_argument("model", help="preset (toy, llama-3.2-1b, ...) or a Hugging Face checkpoint directory")
        p.add_argument("--gpu", default="h100", help="target GPU name (h100, h200, a100, ...) or 'auto'")
        p.add_argument("--config", help=config_help + " (a JSON file, or - for stdin)")
        p.add_argument("--config-json", help="the same, inline JSON text")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", action="store_true", help="machine-readable output")

    def run_opts(p):
        p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        p.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None)
        p.add_argument("--ctx", type=int, default=512, help="context length for latency / roofline")
        p.add_argument("--verify-steps", type=int, default=4)
        p.add_argument("--tag", default=None)

    p = subparsers.add_parser("propose", help="the incumbent schedule + neighbours to try + the search space")
    common(p, "incumbent ScheduleConfig")
    p.add_argument("--log-dir", default="runs", help="read the corpus (corpus.jsonl) from here")
    p.set_defaults(fn=cmd_propose)
    e = subparsers.add_parser("evaluate", help="judge one ScheduleConfig: REJECTED / FAIL / PASS + latency")
    common(e, "ScheduleConfig to evaluate (default: all defaults)")
    run_opts(e)
    e.set_defaults(tag="evaluate")
    e.add_argument("--log-dir", default=None, help="append this trial to DIR/results.tsv (off by default)")
    e.add_argument("--keep", action="store_true", help="with --log-dir: add a correct point to corpus.jsonl")
    e.set_defaults(fn=cmd_evaluate)
    lp = subparsers.add_parser("loop", help="keep/revert schedule search (logs to --log-dir)")
    common(lp, "starting ScheduleConfig (default: best corpus point, else defaults)")
    run_opts(lp)
    lp.add_argument("--log-dir", default="runs", help="results.tsv, corpus.jsonl and the plot go here")
    lp.add_argument("--budget", type=int, default=20, help="number of evaluations, the incumbent's included")
    lp.add_argument("--allow-unverified", action="store_true",
                    help="accept correct=None points (big models on CPU: cost-model search only)")
    lp.set_defaults(fn=cmd_loop)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"amk: error: {message}", file=sys.stderr)
        sys.exit(2)


def main_cli(argv: list[str] | None = None) -> int:
    """Run ``propose`` / ``evaluate`` / ``loop`` stand-alone with the ``amk`` conventions (errors: one line, exit 2)."""
    from schedule.graph import GraphError
    from schedule.ir import IRError
    parser = _Parser(prog="amk")
    sub = parser.add_subparsers(dest="cmd", parser_class=_Parser)
    sub.required = True
    add_cli(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (GraphError, IRError, OSError, json.JSONDecodeError) as e:
        print(f"amk: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2

