// EMBED, RMSNORM, and the shared "stage x (optionally RMS-normalised) into shared memory" step of every GEMV.
//
//   EMBED:   x[c0:c0+cn] = float(table[token, c0:c0+cn])              (token checked: BAD_INPUT if outside [0, vocab))
//   RMSNORM: y = x * (1/sqrt(mean(x^2) + eps)) * w                    (x, y: fp32 [n]; w: any dtype [n])
#pragma once
#include "common.cuh"

// xs[0:K] = x[0:K] (coherent loads), then if nw != nullptr: xs = xs * rsqrt(mean(xs^2) + eps) * nw.
// Ends with a barrier: xs is ready for every thread.                                   x: fp32 [K] global
__device__ __forceinline__ void amk_stage_x(const AmkCtx& c, const float* x, int K, float* xs, const void* nw,
                                            int nw_dt, float eps) {
  float ss = 0.f;
  if ((K & 3) == 0 && amk_aligned16(x)) {
    const float4* x4 = (const float4*)x;
    float4* xs4 = (float4*)xs;
    for (int i = amk_tid(); i < (K >> 2); i += AMK_THREADS) {
      const float4 v = __ldcg(x4 + i);
      xs4[i] = v;
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int i = amk_tid(); i < K; i += AMK_THREADS) {
      const float v = __ldcg(x + i);
      xs[i] = v;
      ss += v * v;
    }
  }
  if (nw != nullptr) {
    ss = amk_block_sum(ss, c.red);  // barriers inside: all of xs is written
    const float r = 1.0f / sqrtf(ss / (float)K + eps);
    for (int i = amk_tid(); i < K; i += AMK_THREADS) xs[i] = (xs[i] * r) * amk_ldw(nw, nw_dt, i);
  }
  __syncthreads();
  amk_mark(c, 1);
}

__device__ __noinline__ void amk_op_embed(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int c0 = in.ip[AMK_EMBED_IP_COL_START], cn = in.ip[AMK_EMBED_IP_COL_COUNT];
  const int V = in.ip[AMK_EMBED_IP_VOCAB], H = in.ip[AMK_EMBED_IP_HIDDEN];
  const int tok = __ldcg((const int*)amk_ptr(c, AMK_EMBED_IN_TOKEN));
  if (tok < 0 || tok >= V) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, tok);
    return;
  }
  const void* table = amk_ptr(c, AMK_EMBED_IN_TABLE);
  const int dt = amk_dtype(c, AMK_EMBED_IN_TABLE);
  float* x = (float*)amk_ptr(c, AMK_EMBED_N_REQUIRED_IN);  // output slot follows the inputs
  const int64_t row = (int64_t)tok * H + c0;
  for (int i = amk_tid(); i < cn; i += AMK_THREADS) x[c0 + i] = amk_ldw(table, dt, row + i);
}

__device__ __noinline__ void amk_op_rmsnorm(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int n = in.ip[AMK_RMSNORM_IP_N];
  const float eps = in.fp[AMK_RMSNORM_FP_EPS];
  const float* x = (const float*)amk_ptr(c, AMK_RMSNORM_IN_X);
  float* y = (float*)amk_ptr(c, AMK_RMSNORM_N_REQUIRED_IN);
  float* xs = c.smem;  // [pad4(n)]
  amk_stage_x(c, x, n, xs, amk_ptr(c, AMK_RMSNORM_IN_W), amk_dtype(c, AMK_RMSNORM_IN_W), eps);
  for (int i = amk_tid(); i < n; i += AMK_THREADS) y[i] = xs[i];
}
