"""What a pipe_micro.cu variant would make of the megakernel's step, phase by phase (no GPU needed).

    /tmp/pm 16 > micro.txt      # scripts/pipe_micro.cu on the device, one or more runs into one file
    python scripts/ring_projection.py micro.txt [--base "reg pf64 gate192"] [--ring "tma 24x8K win6"]
        [--layer qkv=7.65,chain=7.63,o_proj=5.87,gate_up=21.44,down=13.47] [--step 1123.4] [--layers 16]

The microbenchmark times one llama-3.2-1b-shaped step of six dependent phases per layer two ways (docs/PERF.md,
forty-fourth and fiftieth sessions). This applies the difference between two of its variants, family by family
(each family's mean window per layer, averaged over the runs in the file; attention + merge are the megakernel's
attention chain), to the megakernel's own layer (``--layer``, us per phase from `scripts/hop_anatomy.py`'s phase
table; default: the forty-eighth session's H100 trace) and step (``--step``: the measured us per token), and prints
the per-phase deltas, the layer and the projected step. A projection, not a measurement: it assumes the
megakernel's phases would change as the micro's do.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

FAMILIES = ("qkv", "attn", "merge", "o_proj", "gate/up", "down")
# the megakernel's layer phases, in scripts/hop_anatomy.py's PHASES order (its phase table prints --layer with them)
LAYER_PHASES = ("qkv", "chain", "o_proj", "gate_up", "down")
# the megakernel's phase of each micro family (the micro's attention and merge spins are the attention chain)
PHASE_OF = {"qkv": "qkv", "attn": "chain", "merge": "chain", "o_proj": "o_proj", "gate/up": "gate_up",
            "down": "down"}
DEFAULT_LAYER = "qkv=7.65,chain=7.63,o_proj=5.87,gate_up=21.44,down=13.47"   # forty-eighth session, H100


def parse_micro(text: str) -> dict[str, dict[str, float]]:
    """variant name -> {'step': us, family: mean window us}, averaged over every run of the variant in the text."""
    runs: dict[str, list[list[float]]] = {}
    for ln in text.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if not ln.startswith("| ") or len(cells) != 5 + len(FAMILIES) or cells[0] == "variant":
            continue
        try:
            vals = [float(cells[1])] + [float(c) for c in cells[5:]]
        except ValueError:
            continue
        runs.setdefault(cells[0], []).append(vals)
    out = {}
    for name, rows in runs.items():
        mean = [sum(col) / len(col) for col in zip(*rows)]
        out[name] = {"step": mean[0], **dict(zip(FAMILIES, mean[1:])), "runs": len(rows)}
    return out


def parse_layer(spec: str) -> dict[str, float]:
    layer = {}
    for part in spec.split(","):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in LAYER_PHASES:
            raise SystemExit(f"ring_projection: --layer part {part!r} is not PHASE=US with PHASE one of "
                             f"{list(LAYER_PHASES)}")
        layer[k.strip()] = float(v)
    missing = set(LAYER_PHASES) - set(layer)
    if missing:
        raise SystemExit(f"ring_projection: --layer lacks {sorted(missing)}")
    return layer


def project(micro: dict, base: str, ring: str, layer: dict[str, float], step: float, n_layers: int) -> dict:
    """Per megakernel phase: the ring's window minus the base's (summed over the micro families of the phase); the
    layer and the step with those deltas."""
    for name in (base, ring):
        if name not in micro:
            raise SystemExit(f"ring_projection: no variant {name!r} in the micro output (have: {sorted(micro)})")
    delta = {ph: 0.0 for ph in layer}
    for fam, ph in PHASE_OF.items():
        delta[ph] += micro[ring][fam] - micro[base][fam]
    per_layer = sum(delta.values())
    return {"delta": delta, "per_layer": per_layer, "layer": sum(layer.values()),
            "projected_layer": sum(layer.values()) + per_layer, "step": step,
            "projected_step": step + n_layers * per_layer,
            "micro_ratio": micro[ring]["step"] / micro[base]["step"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("micro_output", type=pathlib.Path)
    ap.add_argument("--base", default="reg pf64 gate192 (the megakernel's prefetches)")
    ap.add_argument("--ring", default="tma 24x8K win6")
    ap.add_argument("--layer", default=DEFAULT_LAYER)
    ap.add_argument("--step", type=float, default=1123.4, help="the megakernel's measured us per token")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args(argv)
    micro, layer = parse_micro(a.micro_output.read_text()), parse_layer(a.layer)
    r = project(micro, a.base, a.ring, layer, a.step, a.layers)
    print(f"micro: {a.ring!r} {micro[a.ring]['step']:.1f} us against {a.base!r} {micro[a.base]['step']:.1f} us "
          f"({100 * (r['micro_ratio'] - 1):+.1f}%; {micro[a.ring]['runs']} / {micro[a.base]['runs']} runs)")
    print("| phase | megakernel us | micro delta us |")
    print("|---|---|---|")
    for ph, d in r["delta"].items():
        print(f"| {ph} | {layer[ph]:.2f} | {d:+.2f} |")
    print(f"layer {r['layer']:.2f} -> {r['projected_layer']:.2f} us ({r['per_layer']:+.2f}); step {r['step']:.1f} -> "
          f"{r['projected_step']:.1f} us per token over {a.layers} layers (a projection, not a measurement)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
