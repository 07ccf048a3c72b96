"""Where and why greedy decodes part: AMK's program (reference VM, bf16 weights + bf16 KV cache, fp32 math) vs
transformers eager in fp32 and in bf16, same weights. At the first differing token it prints the top-2 logits of
every side, so a near-tie (a gap below bf16 rounding) can be told from a real bug.

    python scripts/greedy_divergence.py llama-3.2-1b --tokens 64            # CPU: AMK program on the reference VM
    python scripts/greedy_divergence.py llama-3.2-1b --tokens 64 --device cuda   # the GPU megakernel vs HF on the GPU

On the GPU, HF runs its KV-cached ``generate`` (what a user compares against) in bf16 and in fp32 (same bf16 weights,
upcast); at each first difference the fp32 logits of the shared prefix say which side the exact math prefers.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.equivalence import greedy_decode  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import TARGETS, get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402
from vm.reference_vm import ReferenceVM  # noqa: E402


def hf_greedy_logits(model, prompt, n):
    """Greedy tokens and the logits each was chosen from (full recompute each step: no cache differences)."""
    ids, toks, logs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            lo = model(torch.tensor([ids])).logits[0, -1].float()
            t = int(lo.argmax())
            toks.append(t)
            logs.append(lo)
            ids.append(t)
    return toks, logs


def hf_generate_logits(model, prompt, n):
    """HF KV-cached greedy generate: (tokens, per-step logits)."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    return [int(t) for t in out.sequences[0, len(prompt):]], [s[0].float().cpu() for s in out.scores]


def gpu_sides(a, prompt):
    """AMK megakernel (bf16, step by step, logits kept) + HF generate bf16/fp32 on the GPU."""
    from vm.loader import MegakernelVM
    g = load_model(a.model, dtype="bf16", device="cuda")
    prog = lower(g, TARGETS["h100"] if not torch.cuda.is_available() else get_target("auto"), {},
                 max_seq=len(prompt) + a.tokens + 1)
    vm = MegakernelVM(prog, g.weights)
    logs_vm = []

    def step(t, p):
        lo = vm.step(t, p).float().cpu().clone()
        logs_vm.append(lo)
        return lo
    amk = greedy_decode(step, prompt, a.tokens)
    m32 = g.hf_model(dtype="f32", device="cuda")
    hf32, l32 = hf_generate_logits(m32, prompt, a.tokens)
    hf16, l16 = hf_generate_logits(g.hf_model(dtype="bf16", device="cuda"), prompt, a.tokens)
    return amk, logs_vm[len(prompt) - 1:], (hf32, l32), (hf16, l16), m32


def top2(lo):
    v, i = torch.topk(lo.float(), 2)
    return f"top1 {int(i[0])} ({float(v[0]):.4f}), top2 {int(i[1])} ({float(v[1]):.4f}), gap {float(v[0] - v[1]):.4f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default="1,2,3,4")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    t0 = time.time()
    prompt = [int(x) for x in a.prompt.split(",")]
    if a.device == "cuda":
        amk, amk_logs, (hf32, l32), (hf16, l16), m32 = gpu_sides(a, prompt)
        report(a, prompt, t0, amk, amk_logs, hf32, l32, hf16, l16, m32)
        return
    g = load_model(a.model, dtype="bf16")
    prog = lower(g, TARGETS["h100"], {}, max_seq=len(prompt) + a.tokens + 1)
    vm = ReferenceVM(prog, g.weights, check=False)
    logs_vm = []

    def step(t, p):
        lo = vm.step(t, p)
        logs_vm.append(lo)
        return lo
    amk = greedy_decode(step, prompt, a.tokens)
    amk_logs = logs_vm[len(prompt) - 1:]
    hf32, l32 = hf_greedy_logits(g.hf_model(dtype="f32", weights=vm.weight_tensors()), prompt, a.tokens)
    hf16, l16 = hf_greedy_logits(g.hf_model(dtype="bf16"), prompt, a.tokens)
    report(a, prompt, t0, amk, amk_logs, hf32, l32, hf16, l16, None)


def report(a, prompt, t0, amk, amk_logs, hf32, l32, hf16, l16, m32):
    print(f"{a.model}: {a.tokens} greedy tokens after prompt {prompt} ({time.time() - t0:.0f} s)")
    for name, toks, logs in (("HF fp32", hf32, l32), ("HF bf16", hf16, l16)):
        k = next((i for i, (x, y) in enumerate(zip(amk, toks)) if x != y), None)
        if k is None:
            print(f"AMK vs {name}: identical for all {a.tokens} tokens")
            continue
        print(f"AMK vs {name}: identical for {k} tokens, first difference at generated token {k}")
        print(f"   AMK    : {top2(amk_logs[k])}")
        print(f"   {name}: {top2(logs[k])}")
        if m32 is not None:   # exact-math arbiter: fp32 HF on the shared prefix, both candidate tokens
            with torch.no_grad():
                ids = torch.tensor([prompt + amk[:k]], device=next(m32.parameters()).device)
                ref = m32(ids).logits[0, -1].float().cpu()
            x, y = amk[k], toks[k]
            print(f"   HF fp32 full forward on the shared prefix: logit[{x}] (AMK's pick) {float(ref[x]):.4f}, "
                  f"logit[{y}] ({name}'s pick) {float(ref[y]):.4f}, {top2(ref)}")
    k = next((i for i, (x, y) in enumerate(zip(hf32, hf16)) if x != y), None)
    print(f"HF fp32 vs HF bf16: " + ("identical" if k is None else f"first difference at generated token {k}: "
                                      f"fp32 {top2(l32[k])} | bf16 {top2(l16[k])}"))


if __name__ == "__main__":
    main()
