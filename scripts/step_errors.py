"""Device script (issue 4): per-position logit errors of a multi-step program, its one-step program and
transformers' own bf16 eager, all against transformers fp32 eager on the same tokens.

    python scripts/step_errors.py llama-3.1-8b --ctx 512 --steps 8

Why: `amk bench` gates the "8 steps per launch" row on every step of the last launch (eval.bench.check_program:
positions 4..10 after four given tokens). When that gate fails while the one-step row passes, this tells a bug
from the tolerance: if the one-step program and transformers' own bf16 model reach the same error at those
positions, the error is bf16 arithmetic at that position, not the multi-step launch. Prints one row per position
(max |out - ref| / max |ref|, the gate's normwise measure, and whether each output's top-1 matches), then the
one-step vs multi-step difference. JSON to $OUT (or the working directory).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.bench import bench_max_seq, check_tokens, reference_logits  # noqa: E402
from eval.equivalence import TOLERANCES, compare_logits, hf_logits  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402


def _release() -> None:
    """After the caller dropped its last reference to a VM or model: give its GPU memory back (8B-size models hold
    16-32 GB each, and the script holds one at a time)."""
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512, help="the bench context the programs are lowered for")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=8, help="steps per launch of the multi-step program")
    ap.add_argument("--given", type=int, default=4, help="given tokens before the checked launch (as the bench)")
    a = ap.parse_args()
    from vm.loader import MegakernelVM
    g = load_model(a.model, dtype=a.dtype)
    tgt = get_target("auto")
    progs = {n: lower(g, tgt, {"steps_per_launch": n} if n > 1 else {}, max_seq=bench_max_seq(a.ctx))
             for n in (a.steps, 1)}

    # the multi-step program, driven as check_program drives it (its given tokens; transformers runs once, below)
    toks = check_tokens(g.config.vocab, a.given, 0)
    vm = MegakernelVM(progs[a.steps], g.weights)
    out_many = {}
    for i, t in enumerate(toks):
        out_many[i] = vm.step(t, i).float().cpu()
    follow = vm.tokens_all[:a.steps - 1].tolist()
    for s, lg in enumerate(vm.step_logits[1:]):
        out_many[len(toks) + s] = lg.float().cpu()
    vm.check_status()
    del vm
    _release()
    seq = toks + follow
    _, ref = reference_logits(g, tokens=seq)

    vm = MegakernelVM(progs[1], g.weights)
    out_one = {i: vm.step(t, i).float().cpu() for i, t in enumerate(seq)}
    vm.check_status()
    del vm
    _release()

    hf = g.hf_model(dtype=a.dtype, device="cuda")
    out_hf = hf_logits(hf, seq).float().cpu()
    del hf
    _release()

    rtol = TOLERANCES[a.dtype][0]
    rows = []
    print(f"{a.model} {a.dtype}: normwise error max|out - ref| / max|ref| against transformers fp32 eager "
          f"(gate: <= {rtol:g} + atol); * = top-1 differs")
    print(f"{'pos':>4} {'token':>7} {'AMK x' + str(a.steps):>12} {'AMK one-step':>13} {'HF ' + a.dtype:>10} "
          f"{'x{} vs one-step'.format(a.steps):>16}")
    for p, t in enumerate(seq):
        r = {"pos": p, "token": int(t)}
        for key, o in (("many", out_many[p]), ("one", out_one[p]), ("hf", out_hf[p])):
            c = compare_logits(o, ref[p], a.dtype)
            r[key] = c["max_rel_err"]
            r[key + "_top1"] = c["top1_agree"]
            r[key + "_pass"] = c["passed"]
        d = (out_many[p] - out_one[p]).abs().max().item() / max(ref[p].abs().max().item(), 1e-30)
        r["many_vs_one"] = d
        rows.append(r)
        f = lambda k: f"{r[k]:.3e}{'' if r[k + '_top1'] else '*'}"  # noqa: E731
        print(f"{p:>4} {t:>7} {f('many'):>12} {f('one'):>13} {f('hf'):>10} {d:>16.3e}")
    dev = torch.cuda.get_device_name()
    print(f"worst: x{a.steps} {max(r['many'] for r in rows):.3e}, one-step {max(r['one'] for r in rows):.3e}, "
          f"HF {a.dtype} {max(r['hf'] for r in rows):.3e} ({dev})")
    out = pathlib.Path(os.environ.get("OUT", ".")) / f"step_errors_{a.model}_{a.ctx}.json"
    out.write_text(json.dumps({"model": a.model, "dtype": a.dtype, "ctx": a.ctx, "steps": a.steps, "device": dev,
                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
