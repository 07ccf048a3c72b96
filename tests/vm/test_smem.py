"""vm/smem.py: the shared-memory layout the loader sizes launches with (mirror of the kernel's formulas)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from vm.smem import attn_floats, attn_keys, kv_region_bytes, smem_floats

CSRC = pathlib.Path(__file__).resolve().parents[2] / "vm" / "csrc"


def test_attention_smem_areas_by_hand():
    """Keys per KV tile and the attention op's shared memory, worked out by hand (attn_common.cuh layout)."""
    assert attn_keys(64, 2) == 128 and attn_keys(64, 4) == 64 and attn_keys(128, 2) == 64
    assert attn_keys(10, 4) == 256            # capped at ATTN_TILE
    assert attn_keys(8192, 4) == 0            # one key's K and V rows (64 KB) do not fit a 32 KB stage
    assert attn_keys(64, 2, 65536) == 256
    assert attn_keys(96, 2) == 84             # 85 fit: rounded down to a multiple of 4 (float4 probabilities)
    assert attn_keys(2048, 4) == 2            # fewer than 4 fit: kept as is (scalar P.V)
    # G=4, hd=64, 512 threads: q, o 2*256 | scores 4*128 | P.V partials 16 row groups * 4 heads * 64 |
    # (m, l, alpha) pad4(12) = 5132 floats, rounded up to 32 floats (the stages' 128-byte boundary) | 2 stages * 8192
    assert attn_floats(4, 64, 512) == 5152 + 16384
    # G=3, hd=10, 256 threads, 3 stages of 16 KB: q, o 2*pad4(30) | scores pad4(3*256) | rg min(32, 256//5)=32,
    # 32*3*10 | pad4(9) = 1804 -> 1824 | 3 * 4096
    assert attn_floats(3, 10, 256, 3, 16384) == 1824 + 12288
    # G=3, hd=128 (llama-3.2-3b): 2*384 | 3*64 | 8*3*128 | 12 = 4044 floats -> 4064
    assert attn_floats(3, 128, 512) == 4064 + 16384


def test_kv_ahead_moves_the_stages_out_of_the_attention_area():
    """kv_ahead builds: an attention task's op area loses exactly its stages (they are the region at the top of
    shared memory, kv_region_bytes = stages x stage bytes); no other op's area changes."""
    from schedule.ir import Task
    att = Task(0, "ATTN_PARTIAL", [0, 1, 2, 3], [4], params={"kv_head": 0, "group": 4, "head_dim": 64, "max_seq": 64,
                                                       "split": 0, "n_splits": 2})
    gemv = Task(1, "GEMV", [0, 1], [2], params={"k": 2048, "row_start": 0, "row_count": 16, "has_residual": 1})
    assert kv_region_bytes() == 2 * 32768 and kv_region_bytes((3, 16384)) == 3 * 16384
    assert smem_floats(att, 512) - smem_floats(att, 512, kv_top=True) == 2 * 32768 // 4
    assert smem_floats(att, 512, attn=(3, 16384)) - smem_floats(att, 512, attn=(3, 16384), kv_top=True) == 3 * 4096
    assert smem_floats(gemv, 512, kv_top=True) == smem_floats(gemv, 512) == 2048 + 16


PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include "ops_attention.cuh"
int main(int argc, char** argv) {  // host code only: "G D" pairs -> total floats, keys for 2- and 4-byte elements
  for (int i = 1; i + 1 < argc; i += 2) {
    const int G = atoi(argv[i]), D = atoi(argv[i + 1]);
    std::printf("%d %d %d\n", amk_attn_smem(G, D).total, amk_attn_keys(D, 2), amk_attn_keys(D, 4));
  }
  return 0;
}
"""
SHAPES = [(1, 64), (4, 64), (3, 10), (1, 96), (8, 128), (12, 8), (4, 256), (2, 2048)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("threads,stages,stage_bytes", [(512, 2, 32768), (256, 3, 16384)])
def test_attention_layout_matches_the_kernel(tmp_path, threads, stages, stage_bytes):
    """The kernel's own amk_attn_smem / amk_attn_keys, compiled for the host by nvcc, agree with vm/smem.py."""
    src = tmp_path / "probe.cu"
    src.write_text(PROBE)
    exe = tmp_path / "probe"
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", f"-I{CSRC}", f"-DAMK_THREADS={threads}",
                        f"-DAMK_ATTN_STAGES={stages}", f"-DAMK_ATTN_STAGE_BYTES={stage_bytes}", str(src), "-o",
                        str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe), *[str(v) for s in SHAPES for v in s]], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    for (G, D), line in zip(SHAPES, out):
        want = (attn_floats(G, D, threads, stages, stage_bytes), attn_keys(D, 2, stage_bytes),
                attn_keys(D, 4, stage_bytes))
        assert tuple(int(v) for v in line.split()) == want, (G, D)


def test_stash_floats_one_partial_per_row_slice():
    """A task streamed through the weight ring keeps one partial per (row, matrix, K-slice of at most 4 KB):
    the mirror of amk_stash_floats / amk_stream_wpr (vm/csrc/stream.cuh), hand-checked."""
    import types

    from vm.smem import stash_floats
    down = types.SimpleNamespace(op="GEMV", params={"k": 8192, "row_count": 16})       # 16 KB rows: 4 slices
    assert stash_floats(down, 512, 2, 16384) == 16 * 1 * 4
    gate_up = types.SimpleNamespace(op="GEMV_SILU_MUL", params={"k": 2048, "row_count": 62})  # 4 KB rows, 2 mats
    assert stash_floats(gate_up, 480, 2, 16384) == 62 * 2 * 1 + 0   # (124 is already a multiple of 4)
    odd = types.SimpleNamespace(op="GEMV", params={"k": 2504, "row_count": 3})          # 5008 B rows: 2 slices
    assert stash_floats(odd, 512, 2, 16384) == 8                                        # 6, padded to 4
    assert stash_floats(down, 512, 2, 8192) == 0        # a 16 KB row does not fit an 8 KB stage: not streamed
    assert stash_floats(down, 512, 2, 0) == 0           # no ring
