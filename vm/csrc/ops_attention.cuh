// Decode attention for the G query heads of one KV head over key positions [lo, hi):
//   ATTN_DECODE:  out[(kvh*G+g)*hd + d] = softmax(q.K^T * scale) V       (positions [lo, pos], lo from the window)
//   ATTN_PARTIAL: partial row (m, l, o[hd]) of split `split` of n_splits (unnormalised; empty split: -inf, 0, 0)
//   ATTN_MERGE:   out = sum_s o_s e^(m_s-m) / sum_s l_s e^(m_s-m), m = max_s m_s
// 2-byte caches with head_dim 64 / 128 and G <= 8 take the tensor-core path (ops_attention_mma.cuh, included
// below); everything else the generic fp32 path of this file.
// KV cache: [n_kv, max_seq, hd] in the cache dtype. Rows at pos are written this launch, so they are read through L2
// only (cp.async.cg / ld.global.cg), never the non-coherent path.
//
// Tiles of KT keys (amk_attn_keys: K + V rows of a tile fill one AMK_ATTN_STAGE_BYTES stage). The K and V rows of
// a tile are contiguous in the cache, so each tile is two flat copies into a stage buffer with 16-byte cp.async, all
// in flight at once; tile t + STAGES - 1 is issued before tile t is computed, and the first tiles before q is read.
// Per tile, from shared memory: (1) scores, 8 lanes per key (16-byte chunks of the K row); (2) per head, online-
// softmax update of (m, l) and p = e^(s-m) in place; (3) P.V with threads over (key row group, dim pair), partials
// summed over row groups in fixed order and folded into o with alpha. Rows that are not 16-byte aligned (odd head
// dims in fp32/f16 tests) are copied by plain coherent loads instead; the math is the same.
#pragma once
#include "common.cuh"
#include "rope.cuh"
#include "sync.cuh"
#include "attn_common.cuh"

// The tensor-core fast path and the KV copies issued before the wait (use the helpers of attn_common.cuh).
#include "ops_attention_mma.cuh"

// acc[k][g] += K_row_k . q_g (k < 2 keys; row1 may be null) for this lane's part (lane `sl` of an 8-lane group).
// vec (D % T::VE == 0): 16-byte chunks of the rows, q in the chunk-major layout of amk_attn_qidx so that the 8
// lanes of a group read 128 contiguous bytes of q; else element by element with q as [G][D].
template <class T>
__device__ __forceinline__ void amk_kdot2_s(const char* row0, const char* row1, int D, int sl, const float* q, int gn,
                                            bool vec, float (&acc)[2][AMK_ATTN_GB]) {
  if (vec) {
    constexpr int H = T::VE / 4;
    const int nc = D / T::VE;
    for (int cc = sl; cc < nc; cc += 8) {
      float f0[T::VE], f1[T::VE];
      T::unpack(*(const uint4*)(row0 + cc * 16), f0);
      T::unpack(row1 ? *(const uint4*)(row1 + cc * 16) : make_uint4(0u, 0u, 0u, 0u), f1);
#pragma unroll
      for (int g = 0; g < AMK_ATTN_GB; ++g) {
        if (g < gn) {
#pragma unroll
          for (int h = 0; h < H; ++h) {
            const float4 qv = *(const float4*)(q + ((g * H + h) * nc + cc) * 4);
            acc[0][g] = fmaf(f0[4 * h], qv.x, acc[0][g]);
            acc[0][g] = fmaf(f0[4 * h + 1], qv.y, acc[0][g]);
            acc[0][g] = fmaf(f0[4 * h + 2], qv.z, acc[0][g]);
            acc[0][g] = fmaf(f0[4 * h + 3], qv.w, acc[0][g]);
            acc[1][g] = fmaf(f1[4 * h], qv.x, acc[1][g]);
            acc[1][g] = fmaf(f1[4 * h + 1], qv.y, acc[1][g]);
            acc[1][g] = fmaf(f1[4 * h + 2], qv.z, acc[1][g]);
            acc[1][g] = fmaf(f1[4 * h + 3], qv.w, acc[1][g]);
          }
        }
      }
    }
  } else {
    for (int d = sl; d < D; d += 8) {
      const float k0 = T::ld(row0, d), k1 = row1 ? T::ld(row1, d) : 0.f;
#pragma unroll
      for (int g = 0; g < AMK_ATTN_GB; ++g) {
        if (g < gn) {
          acc[0][g] = fmaf(k0, q[g * D + d], acc[0][g]);
          acc[1][g] = fmaf(k1, q[g * D + d], acc[1][g]);
        }
      }
    }
  }
}

// Where element (g, d) of q lives in q_s: [G][D] (scalar path), or chunk-major for the vec path:
// [g][h = (d % VE) / 4][cc = d / VE][4], so lane cc of an 8-lane group reads its float4 next to lane cc+1's.
template <class T>
__device__ __forceinline__ int amk_attn_qidx(int g, int d, int D, bool vec) {
  if (!vec) return g * D + d;
  constexpr int H = T::VE / 4;
  const int nc = D / T::VE, cc = d / T::VE, r = d - cc * T::VE;
  return ((g * H + (r >> 2)) * nc + cc) * 4 + (r & 3);
}

// The attention op's shared-memory areas (pointers derived from the dynamic smem array, so the compiler emits
// 32-bit shared loads, not generic ones) and this thread's fixed roles, set once per task.
struct AmkAttnThread {
  float *q, *o, *sc, *red, *st;
  char* kv;
  int G, D, KT, RG, GBm;
  bool kvec;   // K rows as 16-byte chunks
  bool pv;     // takes part in P.V: row group rg, dim pair dp
  int rg, dp;
  int rpg;     // P.V rows per row group in a full tile
  int og, od;  // first output (head, dim) of the o update; the next are AMK_THREADS further
};

// One tile of tn keys from the stage at ks (K rows; V rows at vs): scores, online softmax, o = o * alpha + P.V.
// Starts after a barrier that published the stage; ends with a barrier (the stage may then be refilled).
template <class T>
__device__ __forceinline__ void amk_attn_tile(const AmkAttnThread& a, const char* ks, const char* vs, int tn,
                                              float scale) {
  const int warp = amk_warp(), lane = amk_lane();
  const int G = a.G, D = a.D, KT = a.KT;
  const int sl = lane & 7, kq = lane >> 3;
  // (1) scores sc[g][j] = (q_g . k_j) * scale: 8 lanes per key, two keys per lane group (j and j + 4*NWARPS),
  // so one pass of the block covers 8*NWARPS keys
  for (int gb = 0; gb < G && !(AMK_DBG_SKIP & 1); gb += AMK_ATTN_GB) {
    const int gn = (G - gb) < AMK_ATTN_GB ? (G - gb) : AMK_ATTN_GB;
    const float* qb = a.q + gb * D;  // heads gb.. of q (both layouts are head-major, D floats per head)
    for (int jw = warp * 4; jw < tn; jw += AMK_NWARPS * 8) {  // warp-uniform trip count
      const int j0 = jw + kq, j1 = j0 + AMK_NWARPS * 4;
      float acc[2][AMK_ATTN_GB];
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g) acc[k][g] = 0.f;
      if (j0 < tn)
        amk_kdot2_s<T>(ks + j0 * D * T::BYTES, j1 < tn ? ks + j1 * D * T::BYTES : nullptr, D, sl, qb, gn, a.kvec,
                       acc);
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
            if (j0 < tn) a.sc[(gb + g) * KT + j0] = acc[0][g] * scale;
            if (j1 < tn) a.sc[(gb + g) * KT + j1] = acc[1][g] * scale;
          }
        }
      }
    }
  }
  amk_sync();
  // (2) online softmax per head: m' = max(m, max_j s), p = e^(s - m'), l' = l e^(m - m') + sum p
  for (int g = warp; g < G && !(AMK_DBG_SKIP & 2); g += AMK_NWARPS) {
    float* s_g = a.sc + g * KT;
    float mx = -INFINITY;
    for (int j = lane; j < tn; j += 32) mx = fmaxf(mx, s_g[j]);
    mx = amk_warp_max(mx);
    const float m_old = a.st[g], m_new = fmaxf(m_old, mx);
    float sum = 0.f;
    for (int j = lane; j < tn; j += 32) {
      const float e = expf(s_g[j] - m_new);
      s_g[j] = e;
      sum += e;
    }
    sum = amk_warp_sum(sum);
    __syncwarp();  // every lane's read of st[g] above is ordered before lane 0 rewrites it (racecheck-explicit)
    if (lane == 0) {
      const float al = expf(m_old - m_new);
      a.st[2 * G + g] = al;
      a.st[G + g] = a.st[G + g] * al + sum;
      a.st[g] = m_new;
    }
  }
  amk_sync();
  // (3) o = o * alpha + P.V. Row group rg takes consecutive rows [j0, j1) (a multiple of 4 per group, so the
  // probabilities of 4 rows are one float4), dim pair dp; partials summed over row groups in fixed order.
  int rpg = a.rpg;
  if (tn != KT) {
    rpg = (tn + a.RG - 1) / a.RG;
    rpg = (KT & 3) == 0 ? (rpg + 3) & ~3 : rpg;
  }
  const int j0 = a.rg * rpg, j1 = (j0 + rpg) < tn ? (j0 + rpg) : tn;
  const int vstep = D * T::BYTES;
  for (int gb = 0; gb < G; gb += AMK_ATTN_GB) {
    const int gn = (G - gb) < AMK_ATTN_GB ? (G - gb) : AMK_ATTN_GB;
    if (a.pv && !(AMK_DBG_SKIP & 4)) {
      float a0[AMK_ATTN_GB], a1[AMK_ATTN_GB];
#pragma unroll
      for (int g = 0; g < AMK_ATTN_GB; ++g) { a0[g] = 0.f; a1[g] = 0.f; }
      const float* pp = a.sc + gb * KT + j0;                      // p[gb][j]
      const char* vp = vs + j0 * vstep + 2 * a.dp * T::BYTES;      // V[j][2 dp]
      int j = j0;
      if ((KT & 3) == 0) {
        for (; j + 4 <= j1; j += 4, pp += 4, vp += 4 * vstep) {
          float2 v[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) v[u] = T::ld2(vp + u * vstep, 0);
#pragma unroll
          for (int g = 0; g < AMK_ATTN_GB; ++g) {
            if (g < gn) {
              const float4 pj = *(const float4*)(pp + g * KT);
              a0[g] = fmaf(pj.x, v[0].x, a0[g]);
              a1[g] = fmaf(pj.x, v[0].y, a1[g]);
              a0[g] = fmaf(pj.y, v[1].x, a0[g]);
              a1[g] = fmaf(pj.y, v[1].y, a1[g]);
              a0[g] = fmaf(pj.z, v[2].x, a0[g]);
              a1[g] = fmaf(pj.z, v[2].y, a1[g]);
              a0[g] = fmaf(pj.w, v[3].x, a0[g]);
              a1[g] = fmaf(pj.w, v[3].y, a1[g]);
            }
          }
        }
      }
      for (; j < j1; ++j, ++pp, vp += vstep) {
        const float2 v = T::ld2(vp, 0);
#pragma unroll
        for (int g = 0; g < AMK_ATTN_GB; ++g) {
          if (g < gn) {
            const float pj = pp[g * KT];
            a0[g] = fmaf(pj, v.x, a0[g]);
            a1[g] = fmaf(pj, v.y, a1[g]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < AMK_ATTN_GB; ++g)
        if (g < gn) *(float2*)(a.red + (a.rg * a.GBm + g) * D + 2 * a.dp) = make_float2(a0[g], a1[g]);
    }
    amk_sync();
    if (!(AMK_DBG_SKIP & 8)) {
      const int n = gn * D, stride = a.GBm * D;
      int g = a.og, d = a.od;
      for (int idx = amk_tid(); idx < n; idx += AMK_THREADS) {
        const float* r = a.red + g * D + d;
        float s = 0.f;
        for (int k = 0; k < a.RG; ++k, r += stride) s += *r;
        float* o = a.o + (gb + g) * D + d;
        *o = *o * a.st[2 * G + gb + g] + s;
        d += AMK_THREADS % D;   // idx += AMK_THREADS as (g, d)
        g += AMK_THREADS / D;
        if (d >= D) { d -= D; ++g; }
      }
    }
    amk_sync();
  }
}

// The tensor-core body for a 2-byte cache, called from the op itself with the smem layout and the checks folded
// for a constant head dim: amk_attn_core's generic-path setup (integer divisions, executed by every warp) and its
// call level cost ~0.9 us of each attention task's critical path (docs/PERF.md, twenty-ninth session).
// false: the body does not take this task (amk_attn_core's generic path does).
// out: the task's output rows for a direct write (amk_attn_mma), or null. q: the KV group's G query rows [G, D]
// (global memory, or the folded QK-norm's rows in shared memory: amk_attn_ldq).
template <class T, int D>
__device__ __forceinline__ bool amk_attn_fast_d(const AmkCtx& c, const float* q, const void* kc, const void* vc,
                                                const AmkAttnRange& r, float scale, float* out, bool partial) {
  const char* kbase = (const char*)kc + (size_t)r.kvh * r.S * (D * 2);
  const char* vbase = (const char*)vc + (size_t)r.kvh * r.S * (D * 2);
  if (!amk_attn_mma_takes(r.G, D, kbase, vbase)) return false;
  const AmkAttnSmem m = amk_attn_smem(r.G, D);
  float* sm = amk_in_smem(c.smem);
  const int cut = r.early ? r.pos : r.lo;  // rows [lo, pos) of the first tiles were issued before the wait
  amk_attn_mma<T, D>(c, q, kbase, vbase, r.G, r.lo, r.hi, cut, scale, sm + m.o,
                     sm + m.st, sm + m.sc, (uint2*)(sm + m.red), amk_attn_kv(c, sm, m), out, partial);
  return true;
}
// Computes st = (m, l) and o_s (unnormalised) over keys [lo, hi). Ends with a barrier. Returns false (after
// reporting BAD_INPUT) if one key's K and V rows do not fit a stage. pos: the row this step appends; early (the
// task's early_kv hint): where the fast path takes the task, rows [lo, pos) of its first tiles were issued before
// the wait (amk_attn_early).
template <class T>
__device__ __noinline__ bool amk_attn_core(const AmkCtx& c, const float* q, const void* kc, const void* vc, int kvh,
                                           int G, int D, int S, int lo, int hi, int pos, bool early,
                                           float scale) {
  const int tid = amk_tid();
  const AmkAttnSmem m = amk_attn_smem(G, D);
  float* sm = amk_in_smem(c.smem);
  AmkAttnThread a;
  a.q = sm;
  a.o = sm + m.o;
  a.sc = sm + m.sc;
  a.red = sm + m.red;
  a.st = sm + m.st;
  a.kv = amk_attn_kv(c, sm, m);
  a.G = G;
  a.D = D;
  a.KT = amk_attn_keys(D, T::BYTES);
  a.RG = amk_attn_rg(D);
  a.GBm = G < AMK_ATTN_GB ? G : AMK_ATTN_GB;
  a.kvec = (D % T::VE) == 0;
  const int halfD = D >> 1;
  a.pv = tid < a.RG * halfD;
  a.rg = a.pv ? tid / halfD : 0;
  a.dp = a.pv ? tid - a.rg * halfD : 0;
  a.og = tid / D;
  a.od = tid - a.og * D;
  const int KT = a.KT;
  a.rpg = KT >= 1 ? (KT + a.RG - 1) / a.RG : 0;
  a.rpg = (KT & 3) == 0 ? (a.rpg + 3) & ~3 : a.rpg;
  if (KT < 1) {
    if (tid == 0) amk_fail(c, AMK_ERR_BAD_INPUT, 2 * D * T::BYTES);
    return false;
  }
  const char* kbase = (const char*)kc + (size_t)kvh * S * D * T::BYTES;
  const char* vbase = (const char*)vc + (size_t)kvh * S * D * T::BYTES;
  const int row = D * T::BYTES;
  const bool vec = row % 16 == 0 && amk_aligned16(kbase) && amk_aligned16(vbase);
#if AMK_ATTN_MMA && !AMK_ATTN_FAST
  if constexpr (T::BYTES == 2) {  // (AMK_ATTN_FAST 0: the tensor-core body called from here, after the setup)
    const AmkAttnRange r{kvh, G, D, S, pos, lo, hi, 0, 1, true, early};
    if ((D == 64 && amk_attn_fast_d<T, 64>(c, q, kc, vc, r, scale, nullptr, false)) ||
        (D == 128 && amk_attn_fast_d<T, 128>(c, q, kc, vc, r, scale, nullptr, false)))
      return true;
  }
#endif
  if (!amk_join(c)) return false;  // a joined task (sync.cuh) waits here, after the setup above
  const int nt = hi > lo ? (hi - lo + KT - 1) / KT : 0;
  // tile t -> stage t % STAGES: K rows at its start, V rows KT rows later. One commit group per tile (empty past
  // the end), so wait_group<STAGES-1> always means "tile t has landed".
  auto issue = [&](int t) {
    if (t < nt && !AMK_DBG_NOLOAD) {
      const int t0 = lo + t * KT, tn = (hi - t0) < KT ? (hi - t0) : KT;
      char* stg = a.kv + (t % AMK_ATTN_STAGES) * AMK_ATTN_STAGE_BYTES;
      amk_attn_copy<T>(stg, kbase + (size_t)t0 * row, tn * row, vec);
      amk_attn_copy<T>(stg + KT * row, vbase + (size_t)t0 * row, tn * row, vec);
    }
    amk_cp_async_commit();
  };
  for (int t = 0; t < AMK_ATTN_STAGES - 1; ++t) issue(t);
  for (int i = tid; i < G * D; i += AMK_THREADS) {  // q lands while the first tiles are in flight
    const int g = i / D;
    a.q[amk_attn_qidx<T>(g, i - g * D, D, a.kvec)] = amk_attn_ldq(q + i);   // (a folded q is o_s: read first)
    a.o[i] = 0.f;
  }
  for (int g = tid; g < G; g += AMK_THREADS) { a.st[g] = -INFINITY; a.st[G + g] = 0.f; a.st[2 * G + g] = 0.f; }
  amk_mark(c, 1);
  for (int t = 0; t < nt; ++t) {
    issue(t + AMK_ATTN_STAGES - 1);
    amk_cp_async_wait<AMK_ATTN_STAGES - 1>();
    amk_sync();
    const int t0 = lo + t * KT, tn = (hi - t0) < KT ? (hi - t0) : KT;
    const char* stg = a.kv + (t % AMK_ATTN_STAGES) * AMK_ATTN_STAGE_BYTES;
    if (!AMK_DBG_NOCOMPUTE) amk_attn_tile<T>(a, stg, stg + KT * row, tn, scale);
  }
  amk_cp_async_wait<0>();
  amk_sync();
  return true;
}

__device__ __forceinline__ bool amk_attn_fast(const AmkCtx& c, int dt, const float* q, const void* kc,
                                              const void* vc, const AmkAttnRange& r, float scale, float* out,
                                              bool partial) {
#if AMK_ATTN_MMA && AMK_ATTN_FAST
  const bool bf = AMK_HAS_DTYPE(AMK_DTYPE_BF16) && dt == AMK_DTYPE_BF16;
  const bool hf = AMK_HAS_DTYPE(AMK_DTYPE_F16) && dt == AMK_DTYPE_F16;
  if (AMK_ATTN_HD64 && r.D == 64) {
    if (bf) return amk_attn_fast_d<AmkBF16, 64>(c, q, kc, vc, r, scale, out, partial);
    if (hf) return amk_attn_fast_d<AmkF16, 64>(c, q, kc, vc, r, scale, out, partial);
  } else if (AMK_ATTN_HD128 && r.D == 128) {
    if (bf) return amk_attn_fast_d<AmkBF16, 128>(c, q, kc, vc, r, scale, out, partial);
    if (hf) return amk_attn_fast_d<AmkF16, 128>(c, q, kc, vc, r, scale, out, partial);
  }
#else
  (void)c; (void)dt; (void)q; (void)kc; (void)vc; (void)r; (void)scale; (void)out; (void)partial;
#endif
  return false;
}

// ATTN_DECODE (partial = false) and ATTN_PARTIAL (partial = true): identical slots up to the output.
__device__ __noinline__ void amk_op_attn(const AmkCtx& c, bool partial) {
  const AmkAttnRange r = amk_attn_range(c, partial);
  const int kvh = r.kvh, G = r.G, D = r.D, S = r.S, lo = r.lo, hi = r.hi, sp = r.sp, ns = r.ns;
  const float scale = c.ins->fp[AMK_ATTN_DECODE_FP_SCALE];
  if (!r.ok) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, r.pos);
    return;
  }
  const void* kc = amk_ptr(c, AMK_ATTN_DECODE_IN_K_CACHE);
  const void* vc = amk_ptr(c, AMK_ATTN_DECODE_IN_V_CACHE);
  const int dt = amk_dtype(c, AMK_ATTN_DECODE_IN_K_CACHE);
  const AmkInstr& in = *c.ins;
  const bool qkn = (partial ? in.ip[AMK_ATTN_PARTIAL_IP_QK_NORM] : in.ip[AMK_ATTN_DECODE_IP_QK_NORM]) != 0;
  const bool appk = qkn && (partial ? in.ip[AMK_ATTN_PARTIAL_IP_APPEND_K] : in.ip[AMK_ATTN_DECODE_IP_APPEND_K]) != 0;
  const int s_out = AMK_ATTN_DECODE_N_REQUIRED_IN + (qkn ? 2 : 0) + (appk ? 2 : 0);  // after the optional inputs
  // the task's output rows: ATTN_PARTIAL [n_kv, ns, G, D+2] at (kvh, sp); ATTN_DECODE [n_kv * G, D] at kvh
  float* const out =
      (float*)amk_ptr(c, s_out) + (partial ? ((int64_t)kvh * ns + sp) * G * (D + 2) : (int64_t)kvh * G * D);
  // the group's q rows: from the q buffer, or (qk_norm) finished here from the RAW rows into o_s
  const float* q = (const float*)amk_ptr(c, AMK_ATTN_DECODE_IN_Q) + (int64_t)kvh * G * D;
  if (qkn) {
    if (!AMK_QK_FOLD) {
      if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, r.pos);
      return;
    }
    if (!(q = amk_attn_fold_qk(c, r, partial, appk, s_out))) return;
  }
  // the tensor-core body, straight from here; AMK_ATTN_DIRECT: it writes out itself
  bool ok = amk_attn_fast(c, dt, q, kc, vc, r, scale, AMK_ATTN_DIRECT ? out : nullptr, partial);
  if (ok && AMK_ATTN_DIRECT) {
    if (!AMK_DBG_ATTN_STAGE_MARKS) amk_mark(c, 2);
    return;
  }
  if (ok && *c.flag) return;  // the body's joined wait stopped the block (nothing to store)
  if (!ok && !amk_dispatch_dtype(c, dt, [&](auto tag) {
        ok = amk_attn_core<decltype(tag)>(c, q, kc, vc, kvh, G, D, S, lo, hi, r.pos, r.early, scale);
      }))
    return;
  if (!ok) return;
  if (!AMK_DBG_ATTN_STAGE_MARKS) amk_mark(c, 2);
  const AmkAttnSmem a = amk_attn_smem(G, D);
  const float* sm = amk_in_smem(c.smem);
  const float* o_s = sm + a.o;
  const float* st = sm + a.st;
  for (int idx = amk_tid(); idx < G * D; idx += AMK_THREADS) {
    const int h = idx / D;
    amk_attn_store(out, partial, D, h, idx - h * D, o_s[idx], st[h], st[G + h]);
  }
}

__device__ __noinline__ void amk_op_attn_merge(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int kvh = in.ip[AMK_ATTN_MERGE_IP_KV_HEAD], G = in.ip[AMK_ATTN_MERGE_IP_GROUP];
  const int D = in.ip[AMK_ATTN_MERGE_IP_HEAD_DIM], ns = in.ip[AMK_ATTN_MERGE_IP_N_SPLITS];
  const float* part = (const float*)amk_ptr(c, AMK_ATTN_MERGE_IN_PARTIAL);  // [n_kv, ns, G, D+2]
  const AmkOut out = amk_out(c, AMK_ATTN_MERGE_N_REQUIRED_IN);
  const float* base = part + (int64_t)kvh * ns * G * (D + 2);
  if (!amk_join(c)) return;  // a joined task (sync.cuh) waits here for the partials
  for (int idx = amk_tid(); idx < G * D; idx += AMK_THREADS) {
    const int g = idx / D;
    const float v = amk_attn_merge_elem(base, ns, G, D, g, idx - g * D, AmkLdCg{}, true);
    AMK_PUT(out, (int64_t)kvh * G * D + idx, v);
  }
}
