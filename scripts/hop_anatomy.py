"""Where a decode step's layers spend their time, from scripts/trace_raw.py's raw timestamps (no GPU needed).

    python scripts/hop_anatomy.py raw_llama-3.2-1b_512_base.npz [--layers 2:14]

Prints the step's outline (embedding, every layer's span, the LM head's window, the argmax, the end; medians over
the traced steps), then, averaged over the traced steps and the middle layers (us, relative to the layer's first
QKV start):
  * per family: execution start (first / median / last), done (first / median / last), median execution and wait;
  * per family with marks (``--marks`` traces): entry / stage / main loop / closing barrier / signal segments;
  * the signal lag of every hop: a waiting task's "waits met" stamp minus the last producer's "done" stamp;
  * the attention chain per KV group: each group's attention execution, each merge's by its block, and when the
    chain ends (last attention done, last merge done, first o_proj "waits met"): the chain waits on its slowest
    group, and which groups are slow differs between processes (docs/PERF.md, thirty-first session);
  * the task loop's head between two tasks of a queue, per family pair, and which family ran before the tile that
    ended each phase;
  * the layer's streaming profile: bytes the executing tasks consume per 0.5 us (each task's est_bytes spread
    evenly over its execution; L2 hits count as well as HBM reads), as TB/s;
  * the layer's phases against their bytes (``--gbps``, default 3000: an H100's copy rate): how long the QKV phase,
    the attention chain (QKV done -> first o_proj "waits met"), o_proj, gate/up and down take, the gaps between
    them, and what their HBM bytes (the trace's hbm_bytes: weights and KV; est_bytes for older traces) would take
    at that rate -- the excess of each over its bytes; its last line is the layer as scripts/ring_projection.py's
    --layer argument.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scripts.ring_projection import LAYER_PHASES  # noqa: E402  (its --layer names, in PHASES' order)
from scripts.trace_breakdown import family  # noqa: E402

ORDER = ["q", "k", "v", "qk_norm", "attn", "attn_merge", "o_proj", "prefetch", "gate_up", "down"]


def families(labels) -> tuple[np.ndarray, np.ndarray]:
    """Per task: its family and layer (trace_breakdown.family), as arrays. Of a multi-step launch (steps_per_launch)
    only step 0 is taken apart: the later steps' tasks get family '?' and layer -1."""
    fl = [("?", -1) if re.match(r"s\d+\.", str(s)) else family(str(s)) for s in labels]
    return np.array([f for f, _ in fl]), np.array([layer for _, layer in fl])


def layer_start(t1_step, fam, lay, L: int) -> float | None:
    """A layer's time origin in one step: its first q task's "waits met" stamp (None: the layer has no q task)."""
    m = (lay == L) & (fam == "q")
    return float(t1_step[m].min()) if m.any() else None


def phases(d, fam, lay, layers) -> list[str]:
    t0, t1, t2 = d["t0"] / 1e3, d["t1"] / 1e3, d["t2"] / 1e3
    rows, span = {}, []
    for s in range(t0.shape[0]):
        for L in layers:
            b, nxt = layer_start(t1[s], fam, lay, L), layer_start(t1[s], fam, lay, L + 1)
            if nxt is not None:
                span.append(nxt - b)
            for f in ORDER:
                m = (lay == L) & (fam == f)
                if m.any():
                    a1, a2 = t1[s][m] - b, t2[s][m] - b
                    rows.setdefault(f, []).append([a1.min(), np.median(a1), a1.max(), a2.min(), np.median(a2),
                                                   a2.max(), np.median(a2 - a1), np.median((t1[s] - t0[s])[m])])
    out = ["family      start: first   med  last | done: first   med  last | exec  wait"]
    for f in ORDER:
        if f in rows:
            a = np.array(rows[f]).mean(0)
            out.append(f"{f:11s} {a[0]:12.2f} {a[1]:5.2f} {a[2]:5.2f} | {a[3]:11.2f} {a[4]:5.2f} {a[5]:5.2f} | "
                       f"{a[6]:5.2f} {a[7]:5.2f}")
    out.append(f"layer span {np.mean(span):.2f} us")
    return out


def segments(d, fam) -> list[str]:
    if "marks" not in d.files or (d["marks"] < 0).all():
        return ["(no marks: trace a -DAMK_MARKS=1 build, trace_raw.py --marks)"]
    mk = d["marks"] / 1e3
    t1, t2 = d["t1"] / 1e3, d["t2"] / 1e3
    out = ["family      entry stage  main close signal (median us; tasks with all four marks)"]
    for f in ORDER + ["lm_head"]:
        m = (fam == f) & (d["marks"][..., :4] > 0).all(axis=2).any(axis=0)
        if m.any():
            seg = [mk[:, m, 0] - t1[:, m], mk[:, m, 1] - mk[:, m, 0], mk[:, m, 2] - mk[:, m, 1],
                   mk[:, m, 3] - mk[:, m, 2], t2[:, m] - mk[:, m, 3]]
            out.append(f"{f:11s} " + " ".join(f"{np.median(x):5.2f}" for x in seg))
    if d["marks"].shape[2] >= 6 and (d["marks"][..., 4] > 0).any():   # a ring build: the producer's marks
        out.append("family      ring producer: first stage issued / last stage issued, us relative to the task's "
                   "waits met (median; negative = before)")
        for f in ORDER + ["lm_head"]:
            m = (fam == f) & (d["marks"][..., 4] > 0).any(axis=0)
            if m.any():
                last = np.where(d["marks"][:, m, 5] > 0, mk[:, m, 5], mk[:, m, 4])
                out.append(f"{f:11s} {np.median(mk[:, m, 4] - t1[:, m]):8.2f} {np.median(last - t1[:, m]):8.2f}")
    if d["marks"].shape[2] >= 70:   # -DAMK_DBG_RING_STAMPS=1: per compute warp, first stage wait over / items done
        out.append("family      ring warps, us after the input staged (median over tasks): first stage wait over "
                   "min / med / max over warps | items done min / med / max | closing (main loop done - last "
                   "warp's items)")
        for f in ORDER + ["lm_head"]:
            m = (fam == f) & (d["marks"][..., 6] > 0).any(axis=0)
            if m.any():
                w = np.where(d["marks"][:, m, 6:70] > 0, mk[:, m, 6:70], np.nan)   # (the build's warps; rest unset)
                done, first = w[..., :32] - mk[:, m, 1:2], w[..., 32:] - mk[:, m, 1:2]
                a = [np.nanmedian(g(x, axis=2)) for x in (first, done) for g in (np.nanmin, np.nanmedian, np.nanmax)]
                close = np.median(mk[:, m, 2] - np.nanmax(w[..., :32], axis=2))
                out.append(f"{f:11s} " + " ".join(f"{x:5.2f}" for x in a[:3]) + " | " +
                           " ".join(f"{x:5.2f}" for x in a[3:]) + f" | {close:5.2f}")
    return out


def lags(d, fam) -> list[str]:
    t0, t1, t2 = d["t0"] / 1e3, d["t1"] / 1e3, d["t2"] / 1e3
    prod: dict[int, list[int]] = {}
    for i, c in enumerate(d["out_counter"]):
        if c >= 0:
            prod.setdefault(int(c), []).append(i)
    res: dict[str, list[float]] = {}
    for i, c in enumerate(d["wait0"]):
        if c < 0 or int(c) not in prod:
            continue
        last = t2[:, prod[int(c)]].max(axis=1)
        waited = t0[:, i] < last
        res.setdefault(fam[i], []).extend((t1[waited, i] - last[waited]).tolist())
    return ["family      signal lag median / p90 (us; tasks that waited)"] + \
        [f"{f:11s} {np.median(v):5.2f} / {np.percentile(v, 90):5.2f}  (n={len(v)})" for f, v in res.items() if v]


def gaps(d, fam, lay, layers) -> list[str]:
    """Between two tasks of one queue: the next task's "reached" stamp minus the task before's "done" (the task
    loop's head: its instruction loads and a barrier), median / p90 per (before -> next) family pair in the given
    layers; then, per phase, which family ran before the task that finished the phase last (its tile ends the
    phase, so what delayed it delays the next phase), with how late its "waits met" was against the phase's median
    (fifty-second session: o_proj tiles behind L2_PREFETCH tasks)."""
    t0, t1, t2 = d["t0"] / 1e3, d["t1"] / 1e3, d["t2"] / 1e3
    qsm, qpos = d["queue_sm"], d["queue_pos"]
    at = {(int(s), int(k)): i for i, (s, k) in enumerate(zip(qsm, qpos))}
    prev = np.array([at.get((int(s), int(k) - 1), -1) for s, k in zip(qsm, qpos)])
    inl = np.isin(lay, layers) & (prev >= 0)
    pairs: dict[tuple[str, str], list[float]] = {}
    for i in np.nonzero(inl)[0]:
        pairs.setdefault((fam[prev[i]], fam[i]), []).extend((t0[:, i] - t2[:, prev[i]]).tolist())
    out = ["task loop head: next reached - before done (us; median / p90, middle layers)"]
    for (a, b), v in sorted(pairs.items(), key=lambda kv: -np.median(kv[1])):
        out.append(f"  {a:10s} -> {b:10s} {np.median(v):5.2f} / {np.percentile(v, 90):5.2f}  (n={len(v)})")
    out.append("the phase's last tile: the family before it on its queue (count), its waits met - the phase's median")
    for f in ORDER:
        ends: dict[str, list[float]] = {}
        for s in range(t0.shape[0]):
            for L in layers:
                m = np.nonzero((lay == L) & (fam == f))[0]
                if len(m) < 2:
                    continue
                last = m[np.argmax(t2[s, m])]
                before = fam[prev[last]] if prev[last] >= 0 else "(first)"
                ends.setdefault(before, []).append(t1[s, last] - np.median(t1[s, m]))
        if ends:
            out.append(f"  {f:10s} " + ", ".join(f"{b} {len(v)} ({np.median(v):+.2f})" for b, v in
                                                  sorted(ends.items(), key=lambda kv: -len(kv[1]))))
    return out


def _group(label: str) -> str:
    """'L4.attn[g5.s2]' / 'L4.attn_merge[g5]' -> 'g5' (the KV group); '' for other labels."""
    m = re.search(r"\[(g\d+)", label)
    return m.group(1) if m else ""


def _group_order(g: str) -> int:
    return int(g[1:]) if g[1:].isdigit() else -1


def chain(d, fam, lay, layers) -> list[str]:
    t1, t2, blk, lab = d["t1"] / 1e3, d["t2"] / 1e3, d["queue_sm"], d["label"]
    attn: dict[str, list[float]] = {}
    merge: dict[tuple[str, int], list[float]] = {}
    ends = []   # per (step, layer): last attention done, last merge done (nan: none), first o_proj waits met
    for s in range(t1.shape[0]):
        for L in layers:
            b = layer_start(t1[s], fam, lay, L)
            if b is None:
                continue
            at, mg, op = ((lay == L) & (fam == f) for f in ("attn", "attn_merge", "o_proj"))
            for i in np.where(at)[0]:
                attn.setdefault(_group(str(lab[i])), []).append(t2[s, i] - t1[s, i])
            for i in np.where(mg)[0]:
                merge.setdefault((_group(str(lab[i])), int(blk[i])), []).append(t2[s, i] - t1[s, i])
            if at.any() and op.any():
                ends.append([t2[s][at].max() - b, t2[s][mg].max() - b if mg.any() else np.nan, t1[s][op].min() - b])
    if not attn:
        return ["(no attention tasks in these layers)"]
    groups = sorted(attn, key=_group_order)
    out = ["attention chain (median us over layers and steps)",
           "  attention exec by KV group: " + "  ".join(f"{g} {np.median(attn[g]):.2f}" for g in groups)]
    if merge:
        keys = sorted(merge, key=lambda gk: (_group_order(gk[0]), gk[1]))
        out.append("  merge exec by group@block: " + "  ".join(f"{g}@{k} {np.median(merge[g, k]):.2f}"
                                                              for g, k in keys))
    if ends:
        e = np.array(ends)
        last_merge = f"{np.median(e[:, 1]):.2f}" if merge else "- (no merge tasks)"
        out.append(f"  last attention done {np.median(e[:, 0]):.2f}, last merge done {last_merge}, "
                   f"first o_proj waits met {np.median(e[:, 2]):.2f}")
    return out


def profile(d, fam, lay, layer: int, dt: float = 0.5) -> list[str]:
    t1, t2, eb = d["t1"][0] / 1e3, d["t2"][0] / 1e3, d["est_bytes"]
    T = float(t2.max())
    rate = np.zeros(int(T / dt) + 2)
    for i in np.where((eb > 0) & (fam != "prefetch") & (t2 > t1))[0]:
        a, b = t1[i], t2[i]
        r = eb[i] / (b - a)
        for k in range(int(a // dt), int(b // dt) + 1):
            lo, hi = max(a, k * dt), min(b, (k + 1) * dt)
            if hi > lo:
                rate[k] += r * (hi - lo)
    rate /= dt * 1e6   # TB/s
    b0, b1 = layer_start(t1, fam, lay, layer), layer_start(t1, fam, lay, layer + 1)
    if b0 is None:
        return [f"(layer {layer} has no q task: no profile)"]
    b1 = b0 + 60 if b1 is None else b1
    out = [f"layer {layer}, step 0: consumed TB/s per {dt} us (est_bytes over each task's execution)"]
    for k in range(int(b0 // dt), int(b1 // dt) + 1):
        out.append(f"{k * dt - b0:6.1f} {rate[k]:5.2f} " + "#" * int(rate[k] * 20))
    return out


PHASES = [("QKV", ("q", "k", "v", "qk_norm")), ("attention chain", ("attn", "attn_merge")), ("o_proj", ("o_proj",)),
          ("gate/up", ("gate_up",)), ("down", ("down",))]


def excess(d, fam, lay, layers, gbps: float) -> list[str]:
    """Medians over the steps and layers (us): each phase's window -- QKV from the layer's start to its last QKV
    task done, the attention chain from there to the first o_proj "waits met", o_proj / gate/up / down from their
    first "waits met" to their last done -- the gaps between them (to the next layer's start), and each phase's
    bytes at ``gbps`` GB/s."""
    t1, t2 = d["t1"] / 1e3, d["t2"] / 1e3
    nb = d["hbm_bytes"] if "hbm_bytes" in d else d["est_bytes"]
    rows = []
    for s in range(t1.shape[0]):
        for L in layers:
            b, nxt = layer_start(t1[s], fam, lay, L), layer_start(t1[s], fam, lay, L + 1)
            masks = [(lay == L) & np.isin(fam, fs) for _, fs in PHASES]
            if nxt is None or not all(m.any() for m in masks):
                continue
            qkv_end = t2[s][masks[0]].max()
            win = [qkv_end - b, t1[s][masks[2]].min() - qkv_end]
            win += [t2[s][m].max() - t1[s][m].min() for m in masks[2:]]
            rows.append(win + [nxt - b - sum(win), nxt - b] + [float(nb[m].sum()) for m in masks])
    if not rows:
        return ["(no complete layer in these layers: no phase table)"]
    a = np.median(np.array(rows), axis=0)
    n = len(PHASES)
    took, gaps, span, nbytes = a[:n], a[n], a[n + 1], a[n + 2:]
    at = nbytes / (gbps * 1e3)
    src = "hbm_bytes" if "hbm_bytes" in d else "est_bytes (input reads included: an older trace)"
    out = [f"phases against their bytes at {gbps:g} GB/s ({src}; median us over layers and steps)",
           "phase              takes      MB  at the rate  excess"]
    for (name, _), tk, mb, r in zip(PHASES, took, nbytes, at):
        out.append(f"{name:16s} {tk:7.2f} {mb / 1e6:7.2f} {r:12.2f} {tk - r:+7.2f}")
    out.append(f"{'gaps':16s} {gaps:7.2f} {'':7s} {'':12s} {gaps:+7.2f}")
    out.append(f"{'layer':16s} {span:7.2f} {nbytes.sum() / 1e6:7.2f} {at.sum():12.2f} {span - at.sum():+7.2f}")
    out.append("scripts/ring_projection.py --layer " + ",".join(f"{k}={t:.2f}" for k, t in zip(LAYER_PHASES, took)))
    return out


def step_outline(d, fam, lay) -> list[str]:
    """The whole step, median over the traced steps (us from the step's first task entry): when the embedding is
    done, every layer's span (first q "waits met" to the next layer's; the last layer's ends at the LM head's first
    "waits met"), the LM head's window and its waves, the argmax, and the last task's end -- what the step spends
    outside the layers' steady state."""
    t0, t1, t2 = d["t0"] / 1e3, d["t1"] / 1e3, d["t2"] / 1e3
    n_layers = int(lay.max()) + 1 if (lay >= 0).any() else 0
    if n_layers == 0 or not (fam == "lm_head").any():
        return ["(no layers or no LM head in this trace)"]
    rows = []
    for s in range(t0.shape[0]):
        o = t0[s].min()
        starts = [layer_start(t1[s], fam, lay, L) for L in range(n_layers)]
        if any(x is None for x in starts):
            return ["(a layer without q tasks: no step outline)"]
        lm = fam == "lm_head"
        ends = starts[1:] + [t1[s][lm].min()]
        emb = t2[s][fam == "embed"].max() - o if (fam == "embed").any() else np.nan
        am = t2[s][fam == "argmax"].max() - o if (fam == "argmax").any() else np.nan
        rows.append([emb, starts[0] - o] + [e - b for b, e in zip(starts, ends)] +
                    [t1[s][lm].min() - o, np.median(t2[s][lm] - t1[s][lm]), t2[s][lm].max() - o, am, t2[s].max() - o])
    a = np.median(np.array(rows), axis=0)
    spans = a[2:2 + n_layers]
    mid = spans[1:-1] if n_layers > 2 else spans
    lm0, lm_exec, lm1, am, end = a[2 + n_layers:]
    out = [f"step outline (us from the first task entry, median of {len(rows)} steps)",
           f"  embed done {a[0]:.2f}, layer 0 starts {a[1]:.2f}",
           "  layer spans: " + " ".join(f"{x:.1f}" for x in spans),
           f"  layers: {spans.sum():.1f} in all; first {spans[0]:.2f}, last (to the LM head) {spans[-1]:.2f}, "
           f"the others {np.mean(mid):.2f} each",
           f"  LM head: first waits met {lm0:.2f}, median task exec {lm_exec:.2f}, last done {lm1:.2f} "
           f"(window {lm1 - lm0:.2f})",
           f"  argmax done {am:.2f}, last task done {end:.2f}; after the LM head {end - lm1:.2f}"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("npz")
    ap.add_argument("--layers", default="2:14", help="middle layers to average, start:stop")
    ap.add_argument("--profile-layer", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=3000.0, help="the copy rate the phase table prices bytes at")
    a = ap.parse_args()
    if a.gbps <= 0:
        ap.error(f"--gbps {a.gbps}: must be > 0")
    d = np.load(a.npz)
    fam, lay = families(d["label"])
    lo, hi = (int(x) for x in a.layers.split(":"))
    layers = [L for L in range(lo, hi) if layer_start(d["t1"][0], fam, lay, L) is not None]
    for block in (step_outline(d, fam, lay), phases(d, fam, lay, layers), segments(d, fam), lags(d, fam),
                  chain(d, fam, lay, layers), gaps(d, fam, lay, layers), profile(d, fam, lay, a.profile_layer),
                  excess(d, fam, lay, layers, a.gbps)):
        print("\n".join(block), end="\n\n")


if __name__ == "__main__":
    main()
