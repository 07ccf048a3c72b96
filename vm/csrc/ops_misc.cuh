// ADD, ARGMAX and L2_PREFETCH.
//   ADD:         y[s:s+n] = a[s:s+n] + b[s:s+n]                    (fp32 activations)
//   ARGMAX:      token[0] = argmax(logits[0:n]); ties -> first index; NaN counts as the maximum (like torch.argmax)
//   L2_PREFETCH: no buffer changes; asks L2 for the instruction's weight ranges (prefetch_ptr/bytes, packed by the
//                loader from w_a[start_a, +count_a) and w_b[start_b, +count_b)), so a later task finds them on chip
#pragma once
#include <limits.h>
#include "common.cuh"
#include "sync.cuh"

__device__ __noinline__ void amk_op_l2_prefetch(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
#pragma unroll
  for (int k = 0; k < AMK_MAX_PREFETCH; ++k) amk_prefetch_range(in.prefetch_ptr[k], in.prefetch_bytes[k]);
}

__device__ __noinline__ void amk_op_add(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int s = in.ip[AMK_ADD_IP_START], n = in.ip[AMK_ADD_IP_COUNT];
  const float* a = (const float*)amk_ptr(c, AMK_ADD_IN_A);
  const float* b = (const float*)amk_ptr(c, AMK_ADD_IN_B);
  float* y = (float*)amk_ptr(c, AMK_ADD_N_REQUIRED_IN);
  for (int i = amk_tid(); i < n; i += AMK_THREADS) y[s + i] = __ldcg(a + s + i) + __ldcg(b + s + i);
}

// (va, ia) beats (vb, ib)? A total order, so the block result does not depend on the reduction order.
__device__ __forceinline__ bool amk_argmax_better(float va, int ia, float vb, int ib) {
  const bool na = va != va, nb = vb != vb;
  if (na != nb) return na;
  if (!na && va != vb) return va > vb;
  return ia < ib;
}

__device__ __noinline__ void amk_op_argmax(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int n = in.ip[AMK_ARGMAX_IP_N];
  const float* logits = (const float*)amk_ptr(c, AMK_ARGMAX_IN_LOGITS);
  int* token = (int*)amk_ptr(c, AMK_ARGMAX_N_REQUIRED_IN);
  float bv = -INFINITY;
  int bi = INT_MAX;
  int vec_end = 0;
  if ((n & 3) == 0 && (((uintptr_t)logits) & 15) == 0) {  // 16-byte loads: 4 float4 in flight per thread
    const float4* l4 = (const float4*)logits;
    const int n4 = n >> 2;
    for (int j0 = amk_tid(); j0 < n4; j0 += AMK_THREADS * 4) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + u * AMK_THREADS;
        v[u] = j < n4 ? __ldcg(l4 + j) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int j = j0 + u * AMK_THREADS;
        if (j < n4) {  // elements 4j..4j+3 in increasing index order keep "first index wins" on ties
          if (amk_argmax_better(v[u].x, 4 * j, bv, bi)) { bv = v[u].x; bi = 4 * j; }
          if (amk_argmax_better(v[u].y, 4 * j + 1, bv, bi)) { bv = v[u].y; bi = 4 * j + 1; }
          if (amk_argmax_better(v[u].z, 4 * j + 2, bv, bi)) { bv = v[u].z; bi = 4 * j + 2; }
          if (amk_argmax_better(v[u].w, 4 * j + 3, bv, bi)) { bv = v[u].w; bi = 4 * j + 3; }
        }
      }
    }
    vec_end = n;
  }
  for (int i0 = vec_end + amk_tid(); i0 < n; i0 += AMK_THREADS * 8) {  // scalar path: 8 loads in flight per thread
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * AMK_THREADS;
      v[u] = i < n ? __ldcg(logits + i) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * AMK_THREADS;
      if (i < n && amk_argmax_better(v[u], i, bv, bi)) { bv = v[u]; bi = i; }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (amk_argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
  }
  int* ri = (int*)c.part;  // [NWARPS] indices, values in red
  if (amk_lane() == 0) { c.red[amk_warp()] = bv; ri[amk_warp()] = bi; }
  __syncthreads();
  if (amk_tid() == 0) {
    for (int w = 1; w < AMK_NWARPS; ++w)
      if (amk_argmax_better(c.red[w], ri[w], bv, bi)) { bv = c.red[w]; bi = ri[w]; }
    token[0] = bi == INT_MAX ? 0 : bi;
  }
}
