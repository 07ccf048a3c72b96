"""Local-memory traffic inside the weight ring's work-item loops, from a compiled object's SASS (no GPU needed).

    python scripts/sass_loops.py mk.o gemv_body silu_body qkv_gemv_body

For each named device function (a substring of its mangled name) of the object's megakernel: the innermost loops
that hold the ring's slot release (`SYNCS.ARRIVE`: a streamed task's work-item loop, vm/csrc/ops_gemv.cuh
amk_gemv_streamed), with their instruction count and their local loads / stores (LDL / STL: context fields re-read
after a "memory"-clobbering mbarrier asm, spill reloads). Every such load that misses the L1 costs an L2 round
trip per work item (docs/PERF.md, forty-sixth session: 7-8 per item before the context reads were hoisted, 3-4
after). Needs `cuobjdump` on PATH or from the pip package nvidia-cuda-cuobjdump (find_cuobjdump).
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
SYMBOL = re.compile(r"\s0x[0-9a-f]+\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+FUNC\s.*\$(\S+)$", re.M)


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one the nvidia-cuda-cuobjdump wheel installs (nvidia/cu*/bin), else None."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels
    except ImportError:
        return None
    found = sorted(c for root in getattr(nvidia, "__path__", []) for c in pathlib.Path(root).glob("cu*/bin/cuobjdump"))
    return str(found[0]) if found else None


def functions(elf: str) -> dict[str, tuple[int, int]]:
    """{mangled device function: (start, end) byte offsets in the kernel's code} from `cuobjdump -elf`."""
    return {name: (int(a, 16), int(a, 16) + int(n, 16)) for a, n, name in SYMBOL.findall(elf)}


def instructions(sass: str) -> list[tuple[int, str]]:
    """(offset, instruction text) of every SASS instruction, in order."""
    return [(int(a, 16), s.strip()) for a, s in INSTR.findall(sass)]


def item_loops(ins: list[tuple[int, str]], lo: int, hi: int) -> list[dict]:
    """The innermost loops (a backward branch's target .. the branch) in [lo, hi) that hold a SYNCS.ARRIVE, each as
    {start, end, instructions, ldl, stl} (offsets relative to lo)."""
    body = [(a, s) for a, s in ins if lo <= a < hi]
    loops = []
    for a, s in body:
        t = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", s)
        if t and lo <= int(t.group(1), 16) < a:
            loops.append((int(t.group(1), 16), a))
    out, seen = [], set()
    for a, s in body:
        if "SYNCS.ARRIVE" not in s:
            continue
        inner = min((l for l in loops if l[0] <= a <= l[1]), key=lambda l: l[1] - l[0], default=None)
        if inner is None or inner in seen:
            continue
        seen.add(inner)
        part = [s2 for a2, s2 in body if inner[0] <= a2 <= inner[1]]
        out.append({"start": inner[0] - lo, "end": inner[1] - lo, "instructions": len(part),
                    "ldl": sum(bool(re.search(r"\bLDL\b", x)) for x in part),
                    "stl": sum(bool(re.search(r"\bSTL\b", x)) for x in part)})
    return out


def ring_loops(obj: str, names: list[str], cuobjdump: str | None = None) -> dict[str, list[dict]]:
    """{name: item_loops of the first function whose mangled name contains it} for a compiled object."""
    exe = cuobjdump or find_cuobjdump()
    if exe is None:
        raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    sass = subprocess.run([exe, "-sass", obj], capture_output=True, text=True, check=True).stdout
    elf = subprocess.run([exe, "-elf", obj], capture_output=True, text=True, check=True).stdout
    ins, funcs = instructions(sass), functions(elf)
    out = {}
    for n in names:
        hits = [r for f, r in funcs.items() if n in f]
        if not hits:
            raise KeyError(f"no device function matching {n!r} in {obj}")
        out[n] = item_loops(ins, *hits[0])
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    for name, loops in ring_loops(argv[0], argv[1:]).items():
        for l in loops:
            print(f"{name:16s} loop +{l['start']:#x}..+{l['end']:#x}: {l['instructions']} instructions, "
                  f"LDL {l['ldl']}, STL {l['stl']}")
        if not loops:
            print(f"{name:16s} no ring item loop (a build without the ring?)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
