// EMBED, RMSNORM, and the shared "stage x (optionally RMS-normalised) into shared memory" step of every GEMV.
//
//   EMBED:   x[c0:c0+cn] = float(table[token, c0:c0+cn])              (token checked: BAD_INPUT if outside [0, vocab))
//   RMSNORM: y = x * (1/sqrt(mean(x^2) + eps)) * w                    (x, y: fp32 [n]; w: any dtype [n])
#pragma once
#include "common.cuh"
#include "sync.cuh"

// The fused RMSNorm weight of a task: its slot and length K, or -1 (no norm).
__device__ __forceinline__ int amk_norm_slot(const AmkInstr& in, int& K) {
  switch (in.op) {
    case AMK_OP_RMSNORM: K = in.ip[AMK_RMSNORM_IP_N]; return AMK_RMSNORM_IN_W;
    case AMK_OP_GEMV: K = in.ip[AMK_GEMV_IP_K]; return in.ip[AMK_GEMV_IP_HAS_NORM] ? AMK_GEMV_N_REQUIRED_IN : -1;
    case AMK_OP_GEMV_SILU_MUL:
      K = in.ip[AMK_GEMV_SILU_MUL_IP_K];
      return in.ip[AMK_GEMV_SILU_MUL_IP_HAS_NORM] ? AMK_GEMV_SILU_MUL_N_REQUIRED_IN : -1;
    case AMK_OP_GEMV_SILU_MUL_DOWN:
      K = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_K];
      return in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_HAS_NORM] ? AMK_GEMV_SILU_MUL_DOWN_N_REQUIRED_IN : -1;
    case AMK_OP_QKV_ROPE:
      K = in.ip[AMK_QKV_ROPE_IP_K];
      return in.ip[AMK_QKV_ROPE_IP_HAS_NORM] ? AMK_QKV_ROPE_N_REQUIRED_IN : -1;
    default: K = 0; return -1;
  }
}

// Shared-memory floats after the op's own area that hold its norm weight (vm/smem.py: smem_floats).
__device__ __forceinline__ int amk_norm_floats(const AmkInstr& in) {
  int K;
  return amk_norm_slot(in, K) >= 0 ? amk_pad4(K) : 0;
}

// Threads first..AMK_THREADS-1 while thread 0 waits: the task's norm weight (read-only) into nw_s as fp32, so
// staging x costs one dependent round trip (x) instead of two (x, then the weight). AMK_PREP_VEC 1: 16-byte loads
// where the size and alignment allow (0: one element per load).
#ifndef AMK_PREP_VEC
#define AMK_PREP_VEC 1
#endif
__device__ __forceinline__ void amk_prep_norm(const AmkParams& p, const AmkInstr& in, float* nw_s, int first) {
  int K;
  const int s = amk_norm_slot(in, K);
  if (s < 0) return;
  const AmkBufDesc& d = p.bufs[in.buf[s]];
  const void* w = (const void*)(uintptr_t)d.ptr;
  const int dt = d.dtype;
  const int ve = dt == AMK_DTYPE_F32 ? 4 : 8;  // elements per 16-byte load
  if (AMK_PREP_VEC && K % ve == 0 && amk_aligned16(w) && amk_aligned16(nw_s)) {
    // 16-byte loads: a task that waits briefly exposes this staging (docs/PERF.md, tenth session)
    for (int i = amk_tid() - first; i < K / ve; i += AMK_THREADS - first) {
      const uint4 v = __ldg((const uint4*)w + i);
      float4* o = (float4*)nw_s + (ve / 4) * i;
      if (dt == AMK_DTYPE_F32) {
        o[0] = make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
      } else {
        float f[8];
        if (dt == AMK_DTYPE_BF16) AmkBF16::unpack(v, f);
        else AmkF16::unpack(v, f);
        o[0] = make_float4(f[0], f[1], f[2], f[3]);
        o[1] = make_float4(f[4], f[5], f[6], f[7]);
      }
    }
    return;
  }
  for (int i = amk_tid() - first; i < K; i += AMK_THREADS - first) nw_s[i] = amk_ldw(w, dt, i);
}

// The split layout of a staged x (AMK_X_SPLIT, default 1), for GEMVs over 2-byte weights with K % 8 == 0: elements
// 8c..8c+3 at xs[4c..4c+3] and 8c+4..8c+7 at xs[K/2 + 4c..]. The GEMV loop's lane reads chunk c's 8 x values as two
// float4 loads; with x linear, 32 lanes reading 32 contiguous bytes each hit every bank twice (a 2-way conflict:
// 16 shared-memory wavefronts per chunk for the warp), split they read 512 contiguous bytes twice (8 wavefronts).
// Every GEMV-family task re-reads x once per weight chunk, so this halves most of its shared-memory traffic.
#ifndef AMK_X_SPLIT
#define AMK_X_SPLIT 1
#endif
__device__ __forceinline__ bool amk_x_split(int weight_bytes, int K) {
  return AMK_X_SPLIT && weight_bytes == 2 && (K & 7) == 0;
}
// The same, for the GEMV whose weights are in `slot` (the staging calls of GEMV, GEMV_SILU_MUL, QKV_ROPE).
__device__ __forceinline__ bool amk_x_split(const AmkCtx& c, int slot, int K) {
  return amk_x_split(amk_dtype_bytes(amk_dtype(c, slot)), K);
}
// Position of element e of a staged x of length K.
__device__ __forceinline__ int amk_xpos(int e, int K, bool split) {
  if (!split) return e;
  const int j = e & 7, c4 = (e >> 3) << 2;
  return j < 4 ? c4 + j : (K >> 1) + c4 + (j - 4);
}

// xs[0:K] = x[0:K] * nw_s (coherent loads; nw_s: the norm weight in shared memory from amk_prep_norm, or null:
// xs = x). Returns the RMSNorm scale r = rsqrt(mean(x^2) + eps) (1 without norm): the consumer multiplies its dot
// products by r (W . (x * nw) * r == W . rmsnorm(x)), so staging costs one round trip and ONE barrier -- the sum
// of squares is reduced per warp before it and summed by every thread after it, in warp order (deterministic).
// split (amk_x_split): xs in the split layout above, for the GEMV loop over 2-byte weights.
// flagged: x is a data-flagged buffer (sync.cuh; x then points at its 8-byte words): every thread polls its own
// elements until they carry the launch's tag -- the wait and the load in one -- and a failed poll (abort, timeout)
// leaves *c.flag set after the barrier: the caller returns at once.
//                                                                                      x: fp32 [K] global
__device__ __forceinline__ float amk_stage_x(const AmkCtx& c, const float* x, int K, float* xs, const float* nw_s,
                                             float eps, bool split = false, bool flagged = false) {
  xs = amk_in_smem(xs);
  float* red = c.red;  // static shared scratch: warp partials of the sum of squares
  float ss = 0.f;
  if (flagged) {
    const uint64_t* xw = (const uint64_t*)x;
    const bool v4 = (K & 3) == 0 && amk_aligned16(xw);
    const int half = split ? (K >> 3) : 0;
    for (int i = amk_tid(); i < (v4 ? (K >> 2) : K); i += AMK_THREADS) {
      if (v4) {
        float4 v;
        if (!amk_ld_flagged4(c, xw + 4 * i, v)) break;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        if (nw_s != nullptr) {
          const float4 w = ((const float4*)amk_in_smem(nw_s))[i];
          v = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
        }
        ((float4*)xs)[split ? (i & 1) * half + (i >> 1) : i] = v;
      } else {
        float v;
        if (!amk_ld_flagged1(c, xw + i, v)) break;
        ss += v * v;
        xs[amk_xpos(i, K, split)] = nw_s != nullptr ? v * amk_in_smem(nw_s)[i] : v;
      }
    }
  } else if ((K & 3) == 0 && amk_aligned16(x)) {
    const float4* x4 = (const float4*)x;
    float4* xs4 = (float4*)xs;
    const int half = split ? (K >> 3) : 0;  // split: float4 i (elements 4i..4i+3) of chunk i/2 -> its half's array
    for (int i = amk_tid(); i < (K >> 2); i += AMK_THREADS) {
      float4 v = __ldcg(x4 + i);
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      if (nw_s != nullptr) {
        const float4 w = ((const float4*)amk_in_smem(nw_s))[i];
        v = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
      }
      xs4[split ? (i & 1) * half + (i >> 1) : i] = v;
    }
  } else {
    for (int i = amk_tid(); i < K; i += AMK_THREADS) {
      const float v = __ldcg(x + i);
      ss += v * v;
      xs[amk_xpos(i, K, split)] = nw_s != nullptr ? v * amk_in_smem(nw_s)[i] : v;
    }
  }
  if (nw_s != nullptr) {
    ss = amk_warp_sum(ss);
    if (amk_lane() == 0) red[amk_warp()] = ss;
  }
  amk_sync();
  amk_mark(c, 1);
  if (nw_s == nullptr) return 1.0f;
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < AMK_NWARPS; ++w) t += red[w];
  return 1.0f / sqrtf(t / (float)K + eps);
}

// EMBED's vector path (build switch, default on): 16-byte loads of the row where the dtype, count and alignment
// allow; 0 keeps the element loop only (same values: a bf16 / f16 element widens to fp32 exactly either way).
#ifndef AMK_EMBED_VEC
#define AMK_EMBED_VEC 1
#endif
__device__ __noinline__ void amk_op_embed(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int c0 = in.ip[AMK_EMBED_IP_COL_START], cn = in.ip[AMK_EMBED_IP_COL_COUNT];
  const int V = in.ip[AMK_EMBED_IP_VOCAB], H = in.ip[AMK_EMBED_IP_HIDDEN];
  // live_token: the step before's argmax output, written in this launch (read after the wait); else the IO input
  const int tok = in.ip[AMK_EMBED_IP_LIVE_TOKEN] ? __ldcg((const int*)amk_ptr(c, AMK_EMBED_IN_TOKEN))
                                                 : amk_io_scalar(c, AMK_EMBED_IN_TOKEN);
  if (tok < 0 || tok >= V) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, tok);
    return;
  }
  const void* table = amk_ptr(c, AMK_EMBED_IN_TABLE);
  const int dt = amk_dtype(c, AMK_EMBED_IN_TABLE);
  float* x = (float*)amk_ptr(c, AMK_EMBED_N_REQUIRED_IN);  // output slot follows the inputs
  const int64_t row = (int64_t)tok * H + c0;
  if (AMK_EMBED_VEC) {  // one 16-byte load per thread, all issued before any store: one round trip
    bool vec = false;
    if (!amk_dispatch_dtype(c, dt, [&](auto tag) {
          using T = decltype(tag);
          const char* src = (const char*)table + row * T::BYTES;
          if (cn % T::VE != 0 || !amk_aligned16(src) || !amk_aligned16(x + c0)) return;
          vec = true;
          for (int i = amk_tid(); i < cn / T::VE; i += AMK_THREADS) {
            float f[T::VE];
            T::unpack(__ldg((const uint4*)src + i), f);
            float4* o = (float4*)(x + c0) + i * (T::VE / 4);
#pragma unroll
            for (int q = 0; q < T::VE / 4; ++q) o[q] = make_float4(f[4 * q], f[4 * q + 1], f[4 * q + 2], f[4 * q + 3]);
          }
        }))
      return;  // (a weight dtype this build lacks: reported)
    if (vec) return;
  }
  // Element by element: a thread's loads and stores alternate (the compiler cannot order the table's loads before
  // the stores into x), so each element is a dependent round trip -- ~4.5 us for the 2048 cold elements of
  // llama-3.2-1b on the critical path of every step (docs/PERF.md, thirty-fifth session).
  for (int i = amk_tid(); i < cn; i += AMK_THREADS) x[c0 + i] = amk_ldw(table, dt, row + i);
}

__device__ __noinline__ void amk_op_rmsnorm(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int n = in.ip[AMK_RMSNORM_IP_N];
  const float eps = in.fp[AMK_RMSNORM_FP_EPS];
  const float* x = (const float*)amk_ptr(c, AMK_RMSNORM_IN_X);
  float* y = (float*)amk_ptr(c, AMK_RMSNORM_N_REQUIRED_IN);
  float* xs = c.smem;  // [pad4(n)]
  const float r = amk_stage_x(c, x, n, xs, c.nw, eps);  // xs = x * w (the weight: amk_prep_norm)
  for (int i = amk_tid(); i < n; i += AMK_THREADS) y[i] = xs[i] * r;
}
