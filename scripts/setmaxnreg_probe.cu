// Compile-only probe (issue 4, no GPU needed): can a weight-ring megakernel give its compute warps more than the
// 96 registers a 17-warp block gets? docs/PERF.md, fifty-first session.
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas=-v -c scripts/setmaxnreg_probe.cu -DAMK_SMR=1
//
// Why: the megakernel's ring build launches 16 compute warps + 1 producer warp; one scheduler then holds 5 warps,
// so ptxas caps every function at 96 registers (the register path, 16 warps, gets 128), which cost ~7% (forty-sixth
// session). sm_90a's setmaxnreg moves registers between warpgroups at run time, inside the block's pool (what it got
// at launch): a block of 5 warpgroups (640 threads) launches at 96 registers each (5 warps per scheduler: 16384 /
// 160 rounded down to 8), 61440 in all; its producer warpgroup dropping to 24 frees 128 x 72 = 9216, enough to
// raise the 4 compute warpgroups by 16 to 112 (8192), not to 120 (12288: setmaxnreg.inc would wait for registers
// the pool never gets). The question a build answers: does ptxas allocate the code AFTER setmaxnreg.inc --
// including __noinline__ callees, as the megakernel's op bodies are -- with the raised limit, or with the launch
// bound's 96?
//
// The probe: a kernel with __launch_bounds__(640, 1) whose compute warpgroups call a __noinline__ body that needs
// more than 96 registers. With AMK_SMR=1 (setmaxnreg.dec 24 in the producer warpgroup, setmaxnreg.inc 112 in the
// others) ptxas -v reports the body without spills; with AMK_SMR=0 it spills 220 bytes (the 96-register cap).
// Answer (nvcc 13.0): the raised limit holds for the callee. A ring build of this shape would give its ops 112
// registers instead of 96 (the register path's 512-thread build has 128); not built or timed yet. Checked in CI by
// tests/vm/test_nvcc_compile.py::test_setmaxnreg_lifts_the_callee_register_cap.
#include <cstdint>

#ifndef AMK_SMR
#define AMK_SMR 1
#endif
constexpr int kComputeThreads = 512;   // 4 warpgroups
constexpr int kThreads = kComputeThreads + 128;  // + the producer warpgroup

// ~100-112 live registers: N running values updated in a loop (an op body's accumulators, pointers and chunks).
template <int N>
__device__ __noinline__ float probe_body(const float* __restrict__ x, int n) {
  float a[N];
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = x[i * 37 % 1024];
  for (int k = 0; k < n; ++k) {
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = fmaf(a[i], a[(i + 1) % N], x[(k + i) & 1023]);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += a[i];
  return s;
}

__global__ void __launch_bounds__(kThreads, 1) probe_kernel(const float* x, float* y, int n) {
  if (threadIdx.x >= kComputeThreads) {  // the producer warpgroup: gives registers back, one thread works
#if AMK_SMR
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
#endif
    if (threadIdx.x == kComputeThreads) y[0] = 1.f;
    return;
  }
#if AMK_SMR
  asm volatile("setmaxnreg.inc.sync.aligned.u32 112;\n" ::: "memory");
#endif
  y[threadIdx.x + 1] = probe_body<100>(x, n);
}
