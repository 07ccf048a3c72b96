"""Device script: a few decode steps of one program, for profilers (ncu / nsys / compute-sanitizer).

    ncu --kernel-name amk_megakernel --launch-skip 6 --launch-count 1 --section WarpStateStats \\
        python scripts/profile_step.py llama-3.2-1b --ctx 512 --steps 8 [--config '{"attn_splits": 8}']
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402
from vm.loader import MegakernelVM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--config", default="{}")
    a = ap.parse_args()
    g = load_model(a.model, dtype=a.dtype, device="cuda")
    prog = lower(g, get_target("auto"), json.loads(a.config), max_seq=a.ctx + a.steps + 1)
    vm = MegakernelVM(prog, g.weights, check=False)
    for i in range(a.steps):
        vm.step(1 + i, a.ctx + i, check=False)
    vm.check_status()
    torch.cuda.synchronize()
    print(f"profile_step: {a.model} {len(prog.tasks)} tasks, {a.steps} steps at ctx {a.ctx}: OK")


if __name__ == "__main__":
    main()
