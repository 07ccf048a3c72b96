// Decode attention for the G query heads of one KV head over key positions [lo, hi):
//   ATTN_DECODE:  out[(kvh*G+g)*hd + d] = softmax(q.K^T * scale) V       (positions [lo, pos], lo from the window)
//   ATTN_PARTIAL: partial row (m, l, o[hd]) of split `split` of n_splits (unnormalised; empty split: -inf, 0, 0)
//   ATTN_MERGE:   out = sum_s o_s e^(m_s-m) / sum_s l_s e^(m_s-m), m = max_s m_s
// KV cache: [n_kv, max_seq, hd] in the cache dtype, read with coherent loads (rows at pos are written this launch).
//
// Tiles of AMK_ATTN_TILE keys: (1) scores, 8 lanes per key (16-byte chunks of the K row), q in smem;
// (2) per head, online-softmax update of (m, l) and p = e^(s-m) in place; (3) P.V with threads over
// (key row-group, dim pair), partials summed over row groups in fixed order and folded into o with alpha.
// smem: q_s[pad4(G*hd)] | o_s[pad4(G*hd)] | sc[G*TILE] | red[pad4(RG*GB*hd)] | st[pad4(3*G)] (m, l, alpha)
#pragma once
#include "common.cuh"

// Row groups of the P.V pass; must match vm/loader.py's smem formula.
__host__ __device__ __forceinline__ int amk_attn_rg(int hd) {
  const int r = AMK_THREADS / (hd / 2 > 0 ? hd / 2 : 1);
  return r < 1 ? 1 : (r > AMK_ATTN_RGMAX ? AMK_ATTN_RGMAX : r);
}

// acc[k][g] += K_row_k . q_s[g] (k < 2 keys at once, so two rows of loads are in flight) for this lane's part
// (lane `sl` of an 8-lane group) of each row. row[1] may be null (no second key).
template <class T>
__device__ __forceinline__ void amk_kdot2(const char* const (&row)[2], int D, int sl, const float* q, int gn,
                                          bool vec, float (&acc)[2][AMK_ATTN_GB]) {
  if (vec) {
    const int nc = D / T::VE;
    for (int cc = sl; cc < nc; cc += 8) {
      uint4 v[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) v[k] = row[k] ? __ldcg((const uint4*)row[k] + cc) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        float f[T::VE];
        T::unpack(v[k], f);
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g) {
          if (g < gn) {
#pragma unroll
            for (int e = 0; e < T::VE; ++e) acc[k][g] = fmaf(f[e], q[g * D + cc * T::VE + e], acc[k][g]);
          }
        }
      }
    }
  } else {
    for (int d = sl; d < D; d += 8) {
      float kv[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) kv[k] = row[k] ? T::cg(row[k], d) : 0.f;
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g)
          if (g < gn) acc[k][g] = fmaf(kv[k], q[g * D + d], acc[k][g]);
    }
  }
}

// Computes st = (m, l) and o_s (unnormalised) over keys [lo, hi). Ends with a barrier.
template <class T>
__device__ __noinline__ void amk_attn_core(const AmkCtx& c, const float* q, const void* kc, const void* vc, int kvh,
                                           int G, int D, int S, int lo, int hi, float scale) {
  const int tid = amk_tid(), warp = amk_warp(), lane = amk_lane();
  float* q_s = c.smem;
  float* o_s = q_s + amk_pad4(G * D);
  float* sc = o_s + amk_pad4(G * D);
  const int RG = amk_attn_rg(D);
  const int GBm = G < AMK_ATTN_GB ? G : AMK_ATTN_GB;
  float* red = sc + G * AMK_ATTN_TILE;
  float* st = red + amk_pad4(RG * GBm * D);
  for (int i = tid; i < G * D; i += AMK_THREADS) {
    q_s[i] = __ldcg(q + (int64_t)kvh * G * D + i);
    o_s[i] = 0.f;
  }
  for (int g = tid; g < G; g += AMK_THREADS) { st[g] = -INFINITY; st[G + g] = 0.f; st[2 * G + g] = 0.f; }
  __syncthreads();
  amk_mark(c, 1);
  const char* kbase = (const char*)kc + (size_t)kvh * S * D * T::BYTES;
  const char* vbase = (const char*)vc + (size_t)kvh * S * D * T::BYTES;
  const bool kvec = (D % T::VE) == 0 && amk_aligned16(kbase);
  const int sl = lane & 7, kq = lane >> 3, halfD = D >> 1;
  // P.V thread map: thread tid < RG*halfD (<= AMK_THREADS) owns key row group prg and dim pair pdp
  const bool pv = tid < RG * halfD;
  const int prg = pv ? tid / halfD : 0, pdp = pv ? tid - prg * halfD : 0;
  for (int t0 = lo; t0 < hi; t0 += AMK_ATTN_TILE) {
    const int tn = (hi - t0) < AMK_ATTN_TILE ? (hi - t0) : AMK_ATTN_TILE;
    // V rows of this thread's first P.V batch: loaded now, so their latency overlaps the K loads of (1)
    float2 vpre[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int jj = prg + u * RG;
      vpre[u] = (pv && jj < tn) ? T::cg2(vbase, (int64_t)(t0 + jj) * D + 2 * pdp) : make_float2(0.f, 0.f);
    }
    // (1) scores sc[g][j] = (q_g . k_{t0+j}) * scale
    for (int gb = 0; gb < G; gb += AMK_ATTN_GB) {
      const int gn = (G - gb) < AMK_ATTN_GB ? (G - gb) : AMK_ATTN_GB;
      // 8 lanes per key, 4 keys per warp, two keys per lane group per iteration (j and j + NWARPS*4)
      for (int jw = warp * 4; jw < tn; jw += AMK_NWARPS * 8) {  // warp-uniform trip count
        const int j0 = jw + kq, j1 = jw + AMK_NWARPS * 4 + kq;
        float acc[2][AMK_ATTN_GB];
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
          for (int g = 0; g < AMK_ATTN_GB; ++g) acc[k][g] = 0.f;
        const char* rows[2] = {j0 < tn ? kbase + (size_t)(t0 + j0) * D * T::BYTES : nullptr,
                               j1 < tn ? kbase + (size_t)(t0 + j1) * D * T::BYTES : nullptr};
        if (rows[0]) amk_kdot2<T>(rows, D, sl, q_s + gb * D, gn, kvec, acc);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
#pragma unroll
          for (int g = 0; g < AMK_ATTN_GB; ++g) {
            acc[k][g] += __shfl_xor_sync(0xffffffffu, acc[k][g], 4);
            acc[k][g] += __shfl_xor_sync(0xffffffffu, acc[k][g], 2);
            acc[k][g] += __shfl_xor_sync(0xffffffffu, acc[k][g], 1);
          }
        }
        if (sl == 0) {
#pragma unroll
          for (int g = 0; g < AMK_ATTN_GB; ++g) {
            if (g < gn) {
              if (j0 < tn) sc[(gb + g) * AMK_ATTN_TILE + j0] = acc[0][g] * scale;
              if (j1 < tn) sc[(gb + g) * AMK_ATTN_TILE + j1] = acc[1][g] * scale;
            }
          }
        }
      }
    }
    __syncthreads();
    // (2) online softmax per head: m' = max(m, max_j s), p = e^(s - m'), l' = l e^(m - m') + sum p
    for (int g = warp; g < G; g += AMK_NWARPS) {
      float* s_g = sc + g * AMK_ATTN_TILE;
      float mx = -INFINITY;
      for (int j = lane; j < tn; j += 32) mx = fmaxf(mx, s_g[j]);
      mx = amk_warp_max(mx);
      const float m_old = st[g], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < tn; j += 32) {
        const float e = expf(s_g[j] - m_new);
        s_g[j] = e;
        sum += e;
      }
      sum = amk_warp_sum(sum);
      __syncwarp();  // every lane's read of st[g] above is ordered before lane 0 rewrites it (racecheck-explicit)
      if (lane == 0) {
        const float a = expf(m_old - m_new);
        st[2 * G + g] = a;
        st[G + g] = st[G + g] * a + sum;
        st[g] = m_new;
      }
    }
    __syncthreads();
    // (3) o = o * alpha + P.V, threads over (row group rg, dim pair dp)
    for (int gb = 0; gb < G; gb += AMK_ATTN_GB) {
      const int gn = (G - gb) < AMK_ATTN_GB ? (G - gb) : AMK_ATTN_GB;
      if (pv) {
        const int rg = prg, dp = pdp;
        float a0[AMK_ATTN_GB], a1[AMK_ATTN_GB];
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g) { a0[g] = 0.f; a1[g] = 0.f; }
        for (int j = rg; j < tn; j += RG * 4) {  // 4 value rows in flight per thread
          float2 v[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int jj = j + u * RG;
            v[u] = j == rg ? vpre[u]
                           : (jj < tn ? T::cg2(vbase, (int64_t)(t0 + jj) * D + 2 * dp) : make_float2(0.f, 0.f));
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int jj = j + u * RG;
            if (jj < tn) {
#pragma unroll
              for (int g = 0; g < AMK_ATTN_GB; ++g) {
                if (g < gn) {
                  const float pj = sc[(gb + g) * AMK_ATTN_TILE + jj];
                  a0[g] = fmaf(pj, v[u].x, a0[g]);
                  a1[g] = fmaf(pj, v[u].y, a1[g]);
                }
              }
            }
          }
        }
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g) {
          if (g < gn) {
            red[(rg * GBm + g) * D + 2 * dp] = a0[g];
            red[(rg * GBm + g) * D + 2 * dp + 1] = a1[g];
          }
        }
      }
      __syncthreads();
      for (int idx = tid; idx < gn * D; idx += AMK_THREADS) {
        const int g = idx / D, d = idx - g * D;
        float s = 0.f;
        for (int rg = 0; rg < RG; ++rg) s += red[(rg * GBm + g) * D + d];
        float* o = o_s + (gb + g) * D + d;
        *o = *o * st[2 * G + gb + g] + s;
      }
      __syncthreads();
    }
  }
}

// ATTN_DECODE (partial = false) and ATTN_PARTIAL (partial = true): identical slots up to the output.
__device__ __noinline__ void amk_op_attn(const AmkCtx& c, bool partial) {
  const AmkInstr& in = *c.ins;
  // ATTN_DECODE and ATTN_PARTIAL share iparam slots 0..4 (kv_head, group, head_dim, max_seq, window)
  const int kvh = in.ip[AMK_ATTN_DECODE_IP_KV_HEAD], G = in.ip[AMK_ATTN_DECODE_IP_GROUP];
  const int D = in.ip[AMK_ATTN_DECODE_IP_HEAD_DIM], S = in.ip[AMK_ATTN_DECODE_IP_MAX_SEQ];
  const int window = in.ip[AMK_ATTN_DECODE_IP_WINDOW];
  const float scale = in.fp[AMK_ATTN_DECODE_FP_SCALE];
  const int pos = amk_io_scalar(c, AMK_ATTN_DECODE_IN_POS);
  if (pos < 0 || pos >= S) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, pos);
    return;
  }
  const int L = pos + 1;
  int lo = window > 0 ? (L - window > 0 ? L - window : 0) : 0, hi = L;
  int sp = 0, ns = 1;
  if (partial) {
    sp = in.ip[AMK_ATTN_PARTIAL_IP_SPLIT];
    ns = in.ip[AMK_ATTN_PARTIAL_IP_N_SPLITS];
    const int64_t n = hi - lo;
    const int a = lo + (int)((n * sp) / ns), b = lo + (int)((n * (sp + 1)) / ns);
    lo = a;
    hi = b;
  }
  const float* q = (const float*)amk_ptr(c, AMK_ATTN_DECODE_IN_Q);
  const void* kc = amk_ptr(c, AMK_ATTN_DECODE_IN_K_CACHE);
  const void* vc = amk_ptr(c, AMK_ATTN_DECODE_IN_V_CACHE);
  if (!amk_dispatch_dtype(c, amk_dtype(c, AMK_ATTN_DECODE_IN_K_CACHE), [&](auto tag) {
        amk_attn_core<decltype(tag)>(c, q, kc, vc, kvh, G, D, S, lo, hi, scale);
      }))
    return;
  amk_mark(c, 2);
  const float* o_s = c.smem + amk_pad4(G * D);
  const int RG = amk_attn_rg(D);
  const int GBm = G < AMK_ATTN_GB ? G : AMK_ATTN_GB;
  const float* st = o_s + amk_pad4(G * D) + G * AMK_ATTN_TILE + amk_pad4(RG * GBm * D);
  float* out = (float*)amk_ptr(c, AMK_ATTN_DECODE_N_REQUIRED_IN);
  if (!partial) {
    for (int idx = amk_tid(); idx < G * D; idx += AMK_THREADS)
      out[(int64_t)kvh * G * D + idx] = o_s[idx] / st[G + idx / D];
  } else {
    const int row = D + 2;
    float* base = out + ((int64_t)kvh * ns + sp) * G * row;
    for (int idx = amk_tid(); idx < G * row; idx += AMK_THREADS) {
      const int g = idx / row, e = idx - g * row;
      base[idx] = e == 0 ? st[g] : (e == 1 ? st[G + g] : o_s[g * D + e - 2]);
    }
  }
}

__device__ __noinline__ void amk_op_attn_merge(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int kvh = in.ip[AMK_ATTN_MERGE_IP_KV_HEAD], G = in.ip[AMK_ATTN_MERGE_IP_GROUP];
  const int D = in.ip[AMK_ATTN_MERGE_IP_HEAD_DIM], ns = in.ip[AMK_ATTN_MERGE_IP_N_SPLITS];
  const float* part = (const float*)amk_ptr(c, AMK_ATTN_MERGE_IN_PARTIAL);  // [n_kv, ns, G, D+2]
  float* out = (float*)amk_ptr(c, AMK_ATTN_MERGE_N_REQUIRED_IN);
  const int row = D + 2;
  for (int idx = amk_tid(); idx < G * D; idx += AMK_THREADS) {
    const int g = idx / D, d = idx - g * D;
    float m = -INFINITY;
    for (int s = 0; s < ns; ++s) m = fmaxf(m, __ldcg(part + (((int64_t)kvh * ns + s) * G + g) * row));
    float l = 0.f, o = 0.f;
    for (int s = 0; s < ns; ++s) {
      const float* r = part + (((int64_t)kvh * ns + s) * G + g) * row;
      const float w = expf(__ldcg(r) - m);
      l = fmaf(__ldcg(r + 1), w, l);
      o = fmaf(__ldcg(r + 2 + d), w, o);
    }
    out[(int64_t)kvh * G * D + idx] = o / l;
  }
}
