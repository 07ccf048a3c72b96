"""Logit / token equivalence against references outside the code under test (HF transformers eager).

Tolerances are dtype-aware: ``|out - ref| <= atol + rtol * max|ref|`` (a normwise bound over the logit vector),
plus top-1 agreement. ``max_rel_err`` is ``max|out - ref| / max|ref|``.
"""
from __future__ import annotations

import torch

# (rtol, atol) per compute dtype of the program's weights / KV cache.
TOLERANCES = {"f32": (1e-5, 1e-6), "bf16": (2e-2, 1e-3), "f16": (5e-3, 1e-4)}


def compare_logits(out: torch.Tensor, ref: torch.Tensor, dtype: str = "f32", rtol: float | None = None) -> dict:
    """Compare one logit vector with its reference. Where the top-1 tokens differ (finite output) the row also
    says by how much: ``ref_top1`` / ``out_top1`` and ``top1_gap`` = ref[ref_top1] - ref[out_top1] (how far the
    output's pick trails in the reference's own logits) against ``tol`` (the absolute logit tolerance); a gap
    within it is a near-tie that the output's allowed error can flip. The gate does not relax for it."""
    out, ref = out.detach().double().cpu().reshape(-1), ref.detach().double().cpu().reshape(-1)
    if out.shape != ref.shape:
        raise ValueError(f"logit shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    rt, at = TOLERANCES[dtype]
    rt = rtol if rtol is not None else rt
    finite = bool(torch.isfinite(out).all())
    diff = (out - ref).abs()
    scale = float(ref.abs().max())
    max_abs = float(diff.max()) if finite else float("inf")
    tol = at + rt * scale
    r = {"max_abs_err": max_abs, "max_rel_err": max_abs / max(scale, 1e-30),
         "top1_agree": bool(int(out.argmax()) == int(ref.argmax())) if finite else False,
         "passed": finite and max_abs <= tol, "tol": tol, "rel_tol": tol / max(scale, 1e-30)}
    if finite and not r["top1_agree"]:
        a, b = int(ref.argmax()), int(out.argmax())
        r.update(ref_top1=a, out_top1=b, top1_gap=float(ref[a] - ref[b]))
    return r


def summarize(rows: list[dict], labels: list[str] | None = None) -> dict:
    """Aggregate per-step comparisons: worst errors, top-1 agreement rate, all passed, ``top1_misses``: the rows
    whose finite output picked another token, and ``over_tolerance``: the rows whose error is over the tolerance
    (``where``: labels[i], default 'step i')."""
    where = labels or [f"step {i}" for i in range(len(rows))]
    misses = [{"where": where[i], **{k: r[k] for k in ("ref_top1", "out_top1", "top1_gap", "tol")}}
              for i, r in enumerate(rows) if "top1_gap" in r]
    over = [{"where": where[i], "max_rel_err": r["max_rel_err"], "rel_tol": r["rel_tol"]}
            for i, r in enumerate(rows) if not r["passed"]]
    return {"steps": len(rows), "max_abs_err": max(r["max_abs_err"] for r in rows),
            "max_rel_err": max(r["max_rel_err"] for r in rows),
            "top1_agreement": sum(r["top1_agree"] for r in rows) / len(rows),
            "passed": all(r["passed"] for r in rows), "top1_misses": misses, "over_tolerance": over}


def describe_misses(s: dict) -> str:
    """One sentence on summarize()'s first top-1 miss ('' without one), e.g. 'top-1 differs at step 12:
    transformers' token 20991 leads the program's 3540 by 0.0075 in transformers' logits (1 row of 19), within the
    logit tolerance 0.0787: a near-tie'."""
    m = s.get("top1_misses") or []
    if not m:
        return ""
    f = m[0]
    tie = (f"within the logit tolerance {f['tol']:.4g}: a near-tie" if f["top1_gap"] <= f["tol"]
           else f"beyond the logit tolerance {f['tol']:.4g}")
    return (f"top-1 differs at {f['where']}: transformers' token {f['ref_top1']} leads the program's "
            f"{f['out_top1']} by {f['top1_gap']:.4g} in transformers' logits ({len(m)} row{'s' if len(m) > 1 else ''} "
            f"of {s['steps']}), {tie}")


def describe_failures(s: dict) -> str:
    """One sentence on where summarize()'s rows went over the tolerance ('' where none did), e.g. 'over the
    tolerance at 2 of 11 rows, first at step 6 of the last launch (position 9): max rel err 2.09e-02 against
    2.00e-02', then describe_misses()'s sentence on a top-1 miss, if any."""
    parts = []
    o = s.get("over_tolerance") or []
    if o:
        f = o[0]
        parts.append(f"over the tolerance at {len(o)} of {s['steps']} row{'s' if s['steps'] > 1 else ''}, first at "
                     f"{f['where']}: max rel err {f['max_rel_err']:.3g} against {f['rel_tol']:.3g}")
    m = describe_misses(s)
    if m:
        parts.append(m)
    return "; ".join(parts)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """HF eager logits for every position of ``tokens`` in one forward: [T, vocab] fp32 on CPU."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([tokens], device=dev)).logits[0].float().cpu()


def hf_greedy(model, prompt: list[int], n_new: int) -> list[int]:
    """HF greedy continuation (KV-cached generate, no sampling): the n_new generated token ids."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    return [int(t) for t in out[0, len(prompt):]]


def verify_steps(step_fn, model, tokens: list[int], dtype: str) -> dict:
    """Run ``step_fn(token, pos) -> logits`` over ``tokens`` and compare each step with HF eager logits."""
    ref = hf_logits(model, tokens)
    rows = [compare_logits(step_fn(t, i), ref[i], dtype) for i, t in enumerate(tokens)]
    return summarize(rows)


def greedy_decode(step_fn, prompt: list[int], n_new: int) -> list[int]:
    """Greedy decode through a VM: prefill the prompt token by token, then feed back the argmax."""
    logits = None
    for i, t in enumerate(prompt):
        logits = step_fn(t, i)
    out = []
    pos = len(prompt)
    for _ in range(n_new):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        if len(out) == n_new:
            break
        logits = step_fn(nxt, pos)
        pos += 1
    return out
