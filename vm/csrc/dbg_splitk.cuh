// Diagnostic (A/B builds only, -DAMK_DBG_SPLITK_QKV=1; docs/PERF.md forty-eighth session, item 4): the COST side of
// QKV as a split-K epilogue of the down tiles, with correct results. After every GEMV tile with a residual and
// K >= AMK_DBG_SPLITK_MIN_K (llama-3.2-1b: the down tiles, K = 8192; o_proj has K = 2048), the block streams
// rn x AMK_DBG_SPLITK_N bf16 weights (a contiguous slice of one of 16 per-layer copies in a 201 MB static device
// array, as a transposed W_qkv's rows [r0, r0 + rn) would be) and adds y[r] * w[r, :] over its rn rows into a
// static fp32 [AMK_DBG_SPLITK_N] accumulator with red.global.add (v4 on sm_90), before the task signals. Nobody
// reads the accumulator, so the program's results are unchanged and the A/B is correctness-gated; the benefit side
// is the AMK_DBG_QKV_NOSTREAM bound (ops_qkv.cuh). Default builds only (flagged y words are not decoded here).
#pragma once
#include "common.cuh"

#ifndef AMK_DBG_SPLITK_QKV
#define AMK_DBG_SPLITK_QKV 0
#endif
#if AMK_DBG_SPLITK_QKV
#ifndef AMK_DBG_SPLITK_N
#define AMK_DBG_SPLITK_N 3072   // llama-3.2-1b: q + k + v rows
#endif
#ifndef AMK_DBG_SPLITK_MIN_K
#define AMK_DBG_SPLITK_MIN_K 4096
#endif
#ifndef AMK_DBG_SPLITK_ROWS
#define AMK_DBG_SPLITK_ROWS 2048   // the hidden size: rows of the transposed weight
#endif
#ifndef AMK_DBG_SPLITK_LAYERS
#define AMK_DBG_SPLITK_LAYERS 16   // weight copies, one per layer: the same 12.6 MB every layer would stay in L2
#endif
static_assert(AMK_DBG_SPLITK_N % 8 == 0, "AMK_DBG_SPLITK_N: whole 16-byte chunks per row");
// bf16 [LAYERS, ROWS, N] (zeros); a block's k-th call reads copy k % LAYERS (one down tile per block and layer)
__device__ uint4 amk_dbg_splitk_w[(size_t)AMK_DBG_SPLITK_LAYERS * AMK_DBG_SPLITK_ROWS * AMK_DBG_SPLITK_N / 8];
__device__ float amk_dbg_splitk_acc[AMK_DBG_SPLITK_N];
__device__ unsigned amk_dbg_splitk_calls[1024];   // per block (grids of up to 1024 blocks)

__device__ __noinline__ void amk_dbg_splitk(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  if (in.ip[AMK_GEMV_IP_HAS_RESIDUAL] == 0 || in.ip[AMK_GEMV_IP_K] < AMK_DBG_SPLITK_MIN_K) return;
  const int r0 = in.ip[AMK_GEMV_IP_ROW_START], rn = in.ip[AMK_GEMV_IP_ROW_COUNT];
  int s = AMK_GEMV_N_REQUIRED_IN + (in.ip[AMK_GEMV_IP_HAS_NORM] != 0) + (in.ip[AMK_GEMV_IP_HAS_BIAS] != 0) + 1;
  const float* y = (const float*)amk_ptr(c, s) + r0;  // this tile's rows, written by this block before the barrier
  const unsigned call = amk_dbg_splitk_calls[blockIdx.x % 1024];  // read by every thread before the barrier
  amk_sync();
  if (*c.flag) return;
  constexpr int NC = AMK_DBG_SPLITK_N / 8;  // 16-byte chunks per weight row
  const uint4* wl = amk_dbg_splitk_w + (size_t)(call % AMK_DBG_SPLITK_LAYERS) * AMK_DBG_SPLITK_ROWS * NC;
  for (int cc = amk_tid(); cc < NC; cc += AMK_THREADS) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 16
    for (int r = 0; r < rn && r0 + r < AMK_DBG_SPLITK_ROWS; ++r) {
      const uint4 w = wl[(size_t)(r0 + r) * NC + cc];
      const float yr = __ldcg(y + r);
      float wf[8];
      AmkBF16::unpack(w, wf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(wf[e], yr, acc[e]);
    }
    float* dst = amk_dbg_splitk_acc + 8 * cc;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(acc[0]), "f"(acc[1]), "f"(acc[2]),
                 "f"(acc[3]) : "memory");
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 4), "f"(acc[4]), "f"(acc[5]),
                 "f"(acc[6]), "f"(acc[7]) : "memory");
#else
    for (int e = 0; e < 8; ++e) atomicAdd(dst + e, acc[e]);
#endif
  }
  if (amk_tid() == 0) amk_dbg_splitk_calls[blockIdx.x % 1024] = call + 1;  // (every thread read it before the barrier)
}
#else
__device__ __forceinline__ void amk_dbg_splitk(const AmkCtx&) {}   // the default: nothing after a GEMV tile
#endif
