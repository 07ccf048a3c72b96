// ADD, ARGMAX and L2_PREFETCH.
//   ADD:         y[s:s+n] = a[s:s+n] + b[s:s+n]                    (fp32 activations)
//   ARGMAX:      token[0] = argmax(logits[0:n]); ties -> first index; NaN counts as the maximum (like torch.argmax)
//   ARGMAX_PARTIAL / ARGMAX_MERGE: the same argmax in two steps (per LM-head tile, then over the tiles' winners)
//   ARGMAX_PAIRS: the same over (value, index) pairs the LM-head tiles computed themselves (GEMV has_argmax)
//   L2_PREFETCH: no buffer changes; asks L2 for the instruction's weight ranges (prefetch_ptr/bytes, packed by the
//                loader from w_a[start_a, +count_a) and w_b[start_b, +count_b)), so a later task finds them on chip
#pragma once
#include <limits.h>
#include "common.cuh"
#include "sync.cuh"

// The requests go out delay_ns after the task starts (knob mlp_prefetch_delay_ns, default 0; 0-1500 ns measured
// equal on llama-3.2-1b, docs/PERF.md sixteenth session). The validator caps delay_ns at 100 us: this sleep does
// not poll the abort flag.
__device__ __noinline__ void amk_op_l2_prefetch(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int delay = in.ip[AMK_L2_PREFETCH_IP_DELAY_NS];
  if (delay > 0) {
    if (amk_tid() == 0) {
      const uint64_t t0 = amk_globaltimer();
      while ((int64_t)(amk_globaltimer() - t0) < delay) __nanosleep(128);
    }
    amk_sync();
  }
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

// This thread's best (value, index) over logits[a, a + n) (indices of the whole vector), folded into (bv, bi).
__device__ __forceinline__ void amk_argmax_scan(const float* logits, int a, int n, float& bv, int& bi) {
  int vec_end = 0;
  if ((a & 3) == 0 && (n & 3) == 0 && (((uintptr_t)(logits + a)) & 15) == 0) {  // 4 float4 in flight per thread
    const float4* l4 = (const float4*)(logits + a);
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
        const int j = j0 + u * AMK_THREADS, e = a + 4 * j;
        if (j < n4) {  // elements e..e+3 in increasing index order keep "first index wins" on ties
          if (amk_argmax_better(v[u].x, e, bv, bi)) { bv = v[u].x; bi = e; }
          if (amk_argmax_better(v[u].y, e + 1, bv, bi)) { bv = v[u].y; bi = e + 1; }
          if (amk_argmax_better(v[u].z, e + 2, bv, bi)) { bv = v[u].z; bi = e + 2; }
          if (amk_argmax_better(v[u].w, e + 3, bv, bi)) { bv = v[u].w; bi = e + 3; }
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
      v[u] = i < n ? __ldcg(logits + a + i) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * AMK_THREADS;
      if (i < n && amk_argmax_better(v[u], a + i, bv, bi)) { bv = v[u]; bi = a + i; }
    }
  }
}

// The block's best of every thread's (bv, bi); the result is valid in thread 0 (bi = INT_MAX: no element).

__device__ __noinline__ void amk_op_argmax(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  float bv = -INFINITY;
  int bi = INT_MAX;
  amk_argmax_scan((const float*)amk_ptr(c, AMK_ARGMAX_IN_LOGITS), 0, in.ip[AMK_ARGMAX_IP_N], bv, bi);
  amk_argmax_block(c, bv, bi);
  if (amk_tid() == 0) ((int*)amk_ptr(c, AMK_ARGMAX_N_REQUIRED_IN))[0] = bi == INT_MAX ? 0 : bi;
}

// The split argmax (one ARGMAX_PARTIAL per LM-head tile, then one ARGMAX_MERGE): the single ARGMAX reads the whole
// vocabulary on one SM after the last LM-head tile (~20 us for 128256 logits on an H100); the partials read each
// tile's rows right after it, and the merge reads one index and one logit per tile.
__device__ __noinline__ void amk_op_argmax_partial(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int a = in.ip[AMK_ARGMAX_PARTIAL_IP_START];
  float bv = -INFINITY;
  int bi = INT_MAX;
  amk_argmax_scan((const float*)amk_ptr(c, AMK_ARGMAX_PARTIAL_IN_LOGITS), a, in.ip[AMK_ARGMAX_PARTIAL_IP_COUNT], bv,
                  bi);
  amk_argmax_block(c, bv, bi);
  if (amk_tid() == 0)
    ((int*)amk_ptr(c, AMK_ARGMAX_PARTIAL_N_REQUIRED_IN))[in.ip[AMK_ARGMAX_PARTIAL_IP_SLOT]] = bi == INT_MAX ? a : bi;
}

// All pairs are loaded at once (one round trip); pair i is (value, index as fp32) of a tile of ascending rows.
__device__ __noinline__ void amk_op_argmax_pairs(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int nc = in.ip[AMK_ARGMAX_PAIRS_IP_N_CAND];
  const float2* pairs = (const float2*)amk_ptr(c, AMK_ARGMAX_PAIRS_IN_PAIRS);
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int i = amk_tid(); i < nc; i += AMK_THREADS) {
    const float2 v = __ldcg(pairs + i);
    const int k = (int)v.y;
    if (amk_argmax_better(v.x, k, bv, bi)) { bv = v.x; bi = k; }
  }
  amk_argmax_block(c, bv, bi);
  if (amk_tid() == 0) ((int*)amk_ptr(c, AMK_ARGMAX_PAIRS_N_REQUIRED_IN))[0] = bi == INT_MAX ? 0 : bi;
}

__device__ __noinline__ void amk_op_argmax_merge(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int n = in.ip[AMK_ARGMAX_MERGE_IP_N], nc = in.ip[AMK_ARGMAX_MERGE_IP_N_CAND];
  const float* logits = (const float*)amk_ptr(c, AMK_ARGMAX_MERGE_IN_LOGITS);
  const int* cand = (const int*)amk_ptr(c, AMK_ARGMAX_MERGE_IN_CAND);
  float bv = -INFINITY;
  int bi = INT_MAX;
  for (int i = amk_tid(); i < nc; i += AMK_THREADS) {  // candidates of ascending ranges: index order = candidate order
    const int k = __ldcg(cand + i);
    if (k < 0 || k >= n) {  // written by an ARGMAX_PARTIAL of this step: never, unless the program is wrong
      amk_fail(c, AMK_ERR_BAD_INPUT, k);
      continue;
    }
    const float v = __ldcg(logits + k);
    if (amk_argmax_better(v, k, bv, bi)) { bv = v; bi = k; }
  }
  amk_argmax_block(c, bv, bi);
  if (amk_tid() == 0) ((int*)amk_ptr(c, AMK_ARGMAX_MERGE_N_REQUIRED_IN))[0] = bi == INT_MAX ? 0 : bi;
}
