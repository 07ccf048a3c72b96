"""Device script (issue 4): does the block -> SM placement of a full-grid cooperative launch depend on what ran
before it, and does the megakernel's speed follow the placement?

    python scripts/sm_mapping_probe.py llama-3.2-1b --ctx 512

A one-VM process timed the same program at 1157-1210 us in states that changed whenever other kernels ran between
timing bursts (scripts/placement_probe.py --triggers). This script builds a tiny probe kernel (each block writes its
%smid; same grid, threads and dynamic shared memory as the VM, cooperative launch) and a `shift` kernel of S
one-warp blocks. Part 1 prints, per S, the probe's block 0 SM and a digest of the whole mapping (twice, back to
back). Part 2 launches shift(S), then times the VM (3 x 30 steps), with the probe's mapping before and after.
Prints tables last.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval.bench import bench_max_seq, check_program, time_vm  # noqa: E402
from schedule.graph import load_model  # noqa: E402
from schedule.ir import get_target  # noqa: E402
from schedule.lower import lower  # noqa: E402

CUDA_SRC = r"""
#include <cuda_runtime.h>
#include <torch/extension.h>
__global__ void smid_probe(int* out) {
  unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  extern __shared__ int sm[];
  if (threadIdx.x == 0) { sm[0] = s; out[blockIdx.x] = sm[0]; }
}
__global__ void shift_k(int* sink) { if (threadIdx.x == 0 && sink[0] == 12345) sink[1] = blockIdx.x; }
void probe(torch::Tensor out, int threads, int smem) {
  cudaFuncSetAttribute(smid_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int* p = out.data_ptr<int>();
  void* args[] = {&p};
  TORCH_CHECK(cudaLaunchCooperativeKernel((void*)smid_probe, dim3(out.numel()), dim3(threads), args, smem, 0)
              == cudaSuccess, "probe launch failed");
}
void shift(torch::Tensor sink, int blocks) { if (blocks > 0) shift_k<<<blocks, 32>>>(sink.data_ptr<int>()); }
"""
CPP_SRC = "void probe(torch::Tensor out, int threads, int smem); void shift(torch::Tensor sink, int blocks);"


def digest(m: list[int]) -> str:
    return hashlib.sha1(json.dumps(m).encode()).hexdigest()[:8]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--shifts", default="0,1,0,1,2,2,5,5,33,33,0,66")
    a = ap.parse_args()
    from torch.utils.cpp_extension import load_inline
    from vm.loader import MegakernelVM
    ext = load_inline("amk_smid_probe", CPP_SRC, cuda_sources=CUDA_SRC, functions=["probe", "shift"],
                      extra_cuda_cflags=["-O2"])
    g = load_model(a.model, dtype="bf16", device="cuda")
    prog = lower(g, get_target("auto"), {}, max_seq=bench_max_seq(a.ctx))
    vm = MegakernelVM(prog, g.weights)
    assert check_program(vm, g, 2)["correct"]
    out = torch.zeros(vm.grid, dtype=torch.int32, device="cuda")
    sink = torch.zeros(2, dtype=torch.int32, device="cuda")

    def mapping():
        ext.probe(out, vm.threads, vm.smem_bytes)
        return out.tolist()

    print(f"grid {vm.grid}, threads {vm.threads}, smem {vm.smem_bytes}, SMs "
          f"{torch.cuda.get_device_properties(0).multi_processor_count}")
    part1 = []
    for s in [0, 1, 2, 3, 5, 8, 16, 33, 66, 131, 0]:
        torch.cuda.synchronize()
        ext.shift(sink, s)
        m1, m2 = mapping(), mapping()
        part1.append((s, m1[0], digest(m1), m2[0], digest(m2), sorted(m1) == list(range(len(m1)))))
    m = mapping()
    print("mapping (block -> smid):", m)
    part2 = []
    for s in [int(x) for x in a.shifts.split(",")]:
        torch.cuda.synchronize()
        ext.shift(sink, s)
        before = mapping()
        ext.shift(sink, s)
        t = [round(time_vm(vm, g.config.vocab, a.ctx, iters=30, repeats=3)["us"], 1) for _ in range(3)]
        part2.append((s, digest(before), before[0], t, digest(mapping())))
    print(f"\n{a.model} ctx {a.ctx}, {torch.cuda.get_device_name()}")
    print("| shift S | probe 1: block 0 on SM, digest | probe 2: block 0, digest | smids 0..grid-1 |\n|---|---|---|---|")
    for s, b1, d1, b2, d2, contig in part1:
        print(f"| {s} | {b1} {d1} | {b2} {d2} | {contig} |")
    print("\n| shift S | mapping before (digest, block 0 SM) | VM us (3 x 30 steps) | mapping after |\n|---|---|---|---|")
    for s, d, b0, t, d2 in part2:
        print(f"| {s} | {d} ({b0}) | {', '.join(map(str, t))} | {d2} |")


if __name__ == "__main__":
    main()
