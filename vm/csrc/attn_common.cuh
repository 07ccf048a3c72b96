// The decode-attention ops' shared pieces (ops_attention.cuh includes this first, then ops_attention_mma.cuh):
// the build switches, the shared-memory layout of a task, the KV row copies, the merge's per-element sums (also
// used by o_proj tasks that merge), the key range of a task, the output row store, the q loads, and the folded
// QK-norm + RoPE of the attention tasks (amk_attn_fold_qk).
// smem (floats): q_s[pad4(G*hd)] | o_s[pad4(G*hd)] | sc[pad4(G*KTmax)] | red[pad4(RG*GB*hd)] | st[pad4(3*G)] (m, l,
// alpha) | AMK_ATTN_STAGES stages of AMK_ATTN_STAGE_BYTES (K rows, then V rows at KT*hd elements)
#pragma once
#include "common.cuh"
#include "rope.cuh"
#include "sync.cuh"
// Profiling switches (wrong results; scripts/trace_breakdown.py variants only): skip the KV copies, skip the
// tile math, or skip phases of it (bits: 1 scores, 2 softmax, 4 P.V, 8 o update).
#ifndef AMK_DBG_NOLOAD
#define AMK_DBG_NOLOAD 0
#endif
#ifndef AMK_DBG_SKIP
#define AMK_DBG_SKIP 0
#endif
#ifndef AMK_DBG_NOCOMPUTE
#define AMK_DBG_NOCOMPUTE 0
#endif

// -DAMK_ATTN_MMA=0 compiles the tensor-core fast path out (A/B builds; every attention task then takes the generic
// path).
#ifndef AMK_ATTN_MMA
#define AMK_ATTN_MMA 1
#endif
// AMK_ATTN_HD64 / AMK_ATTN_HD128: the head dims the tensor-core body is compiled for (default both; the loader
// passes the program's own; a head dim without its body takes the generic path). AMK_QK_FOLD 0: the folded
// QK-norm (amk_attn_fold_qk) compiled out, for programs without it (a task asking for it then fails BAD_INPUT).
#ifndef AMK_ATTN_HD64
#define AMK_ATTN_HD64 1
#endif
#ifndef AMK_ATTN_HD128
#define AMK_ATTN_HD128 1
#endif
#ifndef AMK_QK_FOLD
#define AMK_QK_FOLD 1
#endif
// -DAMK_ATTN_EARLY=0 compiles out the KV copies issued before the wait (amk_attn_early, ops_attention_mma.cuh):
// the early_kv hint is then ignored.
#ifndef AMK_ATTN_EARLY
#define AMK_ATTN_EARLY 1
#endif
#define AMK_ATTN_EARLY_ON (AMK_ATTN_EARLY && AMK_ATTN_MMA)
// AMK_ATTN_FAST 1: amk_op_attn calls the tensor-core body itself (amk_attn_fast); 0 (A/B builds): from
// amk_attn_core, after its generic-path setup, as before the twenty-ninth session.
#ifndef AMK_ATTN_FAST
#define AMK_ATTN_FAST 1
#endif
// AMK_ATTN_DIRECT 1: the tensor-core body writes the task's output rows itself from its cross-warp merge (no o_s /
// st pass through shared memory, no block barrier between, and amk_op_attn returns right after the body: its spilled
// values are not reloaded from the stack); 0 (A/B builds): the op writes them after the body, as before the
// thirtieth session. The same values: the same bits. llama-3.2-1b -2.9% (four code layouts; -1.0% against the op
// loop of amk_attn_store), qwen3-0.6b -2.6%, ctx 8192 -0.8% (docs/PERF.md, thirtieth session).
#ifndef AMK_ATTN_DIRECT
#define AMK_ATTN_DIRECT 1
#endif

// Row groups of the P.V pass; must match vm/smem.py's formula.
__host__ __device__ __forceinline__ int amk_attn_rg(int hd) {
  const int r = AMK_THREADS / (hd / 2 > 0 ? hd / 2 : 1);
  return r < 1 ? 1 : (r > AMK_ATTN_RGMAX ? AMK_ATTN_RGMAX : r);
}
// Keys per tile for elements of `bytes` bytes: K and V rows of the tile fill one stage (0: one key does not fit).
// A multiple of 4 (P.V reads 4 probabilities at once) unless fewer than 4 fit.
__host__ __device__ __forceinline__ int amk_attn_keys(int hd, int bytes) {
  const int k = AMK_ATTN_STAGE_BYTES / (2 * (hd > 0 ? hd : 1) * bytes);
  return k > AMK_ATTN_TILE ? AMK_ATTN_TILE : (k >= 4 ? k & ~3 : k);
}
// Offsets (floats) of the areas above; sc is sized for the smallest element type (2 bytes: the most keys). The KV
// stages start on a 128-byte boundary (the swizzle's unit; the areas before them end on 16 bytes): 48 bytes past
// one (the old layout on llama-3.2-1b / 3b) measured 4.0% / 6.4% slower at ctx 32768 (H100, docs/PERF.md,
// thirty-seventh session).
struct AmkAttnSmem {
  int o, sc, red, st, kv, total;
};
__host__ __device__ __forceinline__ AmkAttnSmem amk_attn_smem(int G, int D) {
  const int GBm = G < AMK_ATTN_GB ? G : AMK_ATTN_GB;
  AmkAttnSmem a;
  a.o = amk_pad4(G * D);
  a.sc = a.o + amk_pad4(G * D);
  a.red = a.sc + amk_pad4(G * amk_attn_keys(D, 2));
  a.st = a.red + amk_pad4(amk_attn_rg(D) * GBm * D);
  a.kv = (a.st + amk_pad4(3 * G) + 31) & ~31;  // (the op area itself starts 128-byte aligned)
  a.total = a.kv + AMK_ATTN_STAGES * (AMK_ATTN_STAGE_BYTES / 4);
  return a;
}
// AMK_KV_AHEAD builds (the program has early_kv 2 tasks; vm/loader.py select_build): the attention stages are not
// part of the op area but a region of AMK_KV_REGION bytes at the TOP of the launch's dynamic shared memory, which no
// other op touches, so the task before an attention task can fill it while it runs itself (amk_kv_ahead).
#ifndef AMK_KV_AHEAD
#define AMK_KV_AHEAD 0
#endif
#define AMK_KV_REGION (AMK_KV_AHEAD ? AMK_ATTN_STAGES * AMK_ATTN_STAGE_BYTES : 0)
__device__ __forceinline__ char* amk_attn_kv_top(const AmkParams& p) {
  return (char*)(amk_dyn_smem + (p.smem_bytes - AMK_KV_REGION));
}
// The stage area of an attention task whose op area starts at sm (floats, shared memory).
__device__ __forceinline__ char* amk_attn_kv(const AmkCtx& c, float* sm, const AmkAttnSmem& m) {
  return AMK_KV_AHEAD ? amk_attn_kv_top(*c.p) : (char*)(sm + m.kv);
}

// Copies `bytes` bytes from global src into shared dst, split over the block: 16-byte cp.async when both ends and
// the length allow (vec), else 2- or 4-byte coherent loads (synchronous; visible after the caller's barrier).
template <class T>
__device__ __forceinline__ void amk_attn_copy(char* dst, const char* src, int bytes, bool vec) {
  if (vec) {
    for (int i = amk_tid() * 16; i < bytes; i += AMK_THREADS * 16) amk_cp_async16(dst + i, src + i);
  } else if (T::BYTES == 4) {
    for (int i = amk_tid(); i < bytes / 4; i += AMK_THREADS) ((float*)dst)[i] = __ldcg((const float*)src + i);
  } else {
    for (int i = amk_tid(); i < bytes / 2; i += AMK_THREADS)
      ((unsigned short*)dst)[i] = __ldcg((const unsigned short*)src + i);
  }
}

// Element (g, d) of the merge of one KV head's ns split partials (rows (m, l, o[D]) at base + (s*G + g)*(D+2)):
// sum_s o_s[d] e^(m_s - m) / sum_s l_s e^(m_s - m), m = max_s m_s -- the one definition of the merge arithmetic, shared
// by ATTN_MERGE (ld: coherent global loads) and a GEMV's merged x (ops_gemv.cuh; ld: shared memory), so both give
// the same bits.
struct AmkLdCg {
  __device__ __forceinline__ float operator()(const float* p) const { return __ldcg(p); }
};
struct AmkLdPlain {
  __device__ __forceinline__ float operator()(const float* p) const { return *p; }
};
// ATTN_MERGE's global reads: for up to AMK_MERGE_UNROLL splits (4, 8 or 16; 0 = never) all 3 * ns loads of an
// element are issued before the first use (one round trip to L2 instead of two: the max pass, then the weighted
// sums), U = the smallest of 4 / 8 / 16 that covers ns; splits past ns re-read the last one (a guarded load made
// ptxas spill). More splits (and the shared-memory reads of a GEMV's merged x) take the loop. Both compute the same
// operations in the same order, so the bits do not depend on the path. The loader compiles only the smallest U that
// covers the program's splits (vm/loader.py merge_unroll_for): ATTN_MERGE runs once per layer on an SM whose
// instruction cache holds other ops' code, and with the 8- and 16-split bodies in the function (22.8 KB of SASS
// against 10.2 KB) a 4-split merge took 0.5 us longer and llama-3.2-1b 1.2% (docs/PERF.md, twenty-eighth session).
#ifndef AMK_MERGE_UNROLL
#define AMK_MERGE_UNROLL 16
#endif
template <int U, class Ld>
__device__ __forceinline__ float amk_attn_merge_unrolled(const float* base, int ns, int G, int g, int d, int row,
                                                         Ld ld) {
  float mv[U], lv[U], ov[U];
#pragma unroll
  for (int s = 0; s < U; ++s) {
    const float* r = base + ((s < ns ? s : ns - 1) * G + g) * row;
    mv[s] = ld(r);
    lv[s] = ld(r + 1);
    ov[s] = ld(r + 2 + d);
  }
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < U; ++s)
    if (s < ns) m = fmaxf(m, mv[s]);
  float l = 0.f, o = 0.f;
#pragma unroll
  for (int s = 0; s < U; ++s) {
    if (s < ns) {
      const float w = expf(mv[s] - m);
      l = fmaf(lv[s], w, l);
      o = fmaf(ov[s], w, o);
    }
  }
  return o / l;
}
template <class Ld>
__device__ __forceinline__ float amk_attn_merge_elem(const float* base, int ns, int G, int D, int g, int d, Ld ld,
                                                     bool unrolled = false) {
  const int row = D + 2;
  if (unrolled && ns >= 1) {
    if (AMK_MERGE_UNROLL >= 4 && ns <= 4) return amk_attn_merge_unrolled<4>(base, ns, G, g, d, row, ld);
    if (AMK_MERGE_UNROLL >= 8 && ns <= 8) return amk_attn_merge_unrolled<8>(base, ns, G, g, d, row, ld);
    if (AMK_MERGE_UNROLL >= 16 && ns <= 16) return amk_attn_merge_unrolled<16>(base, ns, G, g, d, row, ld);
  }
  float m = -INFINITY;
  for (int s = 0; s < ns; ++s) m = fmaxf(m, ld(base + (s * G + g) * row));
  float l = 0.f, o = 0.f;
  for (int s = 0; s < ns; ++s) {
    const float* r = base + (s * G + g) * row;
    const float w = expf(ld(r) - m);
    l = fmaf(ld(r + 1), w, l);
    o = fmaf(ld(r + 2 + d), w, o);
  }
  return o / l;
}

// An attention task's keys: positions [lo, hi) of KV head kvh (ATTN_PARTIAL: split sp of ns of them) and pos, the
// row this step appends. The one definition for the op and for the KV copies issued before its wait
// (amk_attn_early), so both take the same rows. ok = false: pos outside the cache.
struct AmkAttnRange {
  int kvh, G, D, S, pos, lo, hi, sp, ns;
  bool ok;
  bool early;  // the task's early_kv hint (AMK_ATTN_EARLY builds): its KV history was issued before its wait
};
// An ATTN_DECODE / ATTN_PARTIAL instruction's early_kv hint (0 for every other op): 1 = the task issues its KV
// history before its own wait (amk_attn_early), 2 = the task before it in the queue did (amk_kv_ahead; AMK_KV_AHEAD
// builds only).
__device__ __forceinline__ int amk_attn_early_value(const AmkInstr& in) {
  const int v = in.op == AMK_OP_ATTN_PARTIAL ? in.ip[AMK_ATTN_PARTIAL_IP_EARLY_KV]
                : in.op == AMK_OP_ATTN_DECODE ? in.ip[AMK_ATTN_DECODE_IP_EARLY_KV] : 0;
  return !AMK_ATTN_EARLY_ON ? 0 : v == 1 ? 1 : (v == 2 && AMK_KV_AHEAD) ? 2 : 0;
}
// Whether the task itself issues its KV history before its wait (early_kv 1).
__device__ __forceinline__ bool amk_attn_early_hint(const AmkInstr& in) { return amk_attn_early_value(in) == 1; }
// The keys of attention instruction `in` (shared or global memory) at position pos.
__device__ __forceinline__ AmkAttnRange amk_attn_range_of(const AmkInstr& in, int pos, bool partial) {
  // ATTN_DECODE and ATTN_PARTIAL share iparam slots 0..4 (kv_head, group, head_dim, max_seq, window)
  AmkAttnRange r;
  r.kvh = in.ip[AMK_ATTN_DECODE_IP_KV_HEAD];
  r.G = in.ip[AMK_ATTN_DECODE_IP_GROUP];
  r.D = in.ip[AMK_ATTN_DECODE_IP_HEAD_DIM];
  r.S = in.ip[AMK_ATTN_DECODE_IP_MAX_SEQ];
  const int window = in.ip[AMK_ATTN_DECODE_IP_WINDOW];
  r.pos = pos;
  r.ok = r.pos >= 0 && r.pos < r.S;
  r.early = amk_attn_early_value(in) != 0;
  const int L = r.pos + 1;
  r.lo = window > 0 ? (L - window > 0 ? L - window : 0) : 0;
  r.hi = L;
  r.sp = 0;
  r.ns = 1;
  if (partial) {
    r.sp = in.ip[AMK_ATTN_PARTIAL_IP_SPLIT];
    r.ns = in.ip[AMK_ATTN_PARTIAL_IP_N_SPLITS];
    const int n = r.hi - r.lo, lo = r.lo, ns = r.ns;  // floor(n * k / ns): 32-bit division where n * ns fits
    const bool small = (int64_t)n * ns <= 0x7fffffff;  // (a 64-bit one is a slow call)
    auto bound = [&](int k) {
      return lo + (small ? (int)((unsigned)(n * k) / (unsigned)ns) : (int)(((int64_t)n * k) / ns));
    };
    r.lo = bound(r.sp);
    r.hi = bound(r.sp + 1);
  }
  return r;
}
__device__ __forceinline__ AmkAttnRange amk_attn_range(const AmkCtx& c, bool partial) {
  return amk_attn_range_of(*c.ins, amk_io_scalar(c, AMK_ATTN_DECODE_IN_POS), partial);
}

// Element (h, d) of an attention task's output rows, with its head's (m, l): the one definition of their layout --
// ATTN_PARTIAL (partial) [G, (m, l, o[D])] per split, o unnormalised, m in natural units of score * scale (ATTN_MERGE
// and a GEMV's merged x read it); ATTN_DECODE [G, D] as o / l.
__device__ __forceinline__ void amk_attn_store(float* out, bool partial, int D, int h, int d, float o, float m,
                                               float l) {
  if (partial) {
    float* b = out + h * (D + 2);
    b[2 + d] = o;
    if (d == 0) {
      b[0] = m;
      b[1] = l;
    }
  } else {
    out[h * D + d] = o / l;
  }
}

// The bodies' q reads: the q buffer's rows are written this launch by other SMs, so they are read through L2 only
// (ld.global.cg); a folded QK-norm (amk_attn_fold_qk) leaves the rows in shared memory instead.
__device__ __forceinline__ float amk_attn_ldq(const float* p) { return __isShared(p) ? *p : __ldcg(p); }
__device__ __forceinline__ float2 amk_attn_ldq2(const float2* p) { return __isShared(p) ? *p : __ldcg(p); }

// Whether the folded QK-norm's scratch fits the task's areas: the raw K row, both norm weights and inv_freq (3.5 D
// floats) from the score area up to the KV stages (the raw q rows use q_s, the finished ones o_s). Mirror of
// vm/smem.py attn_fold_fits.
__host__ __device__ __forceinline__ bool amk_attn_fold_fits(const AmkAttnSmem& m, int D) {
  return D >= 2 && D % 2 == 0 && m.kv - m.sc >= 3 * D + D / 2;
}

// The attention ops' folded QK-norm (qk_norm; QK-norm models whose QKV tasks write RAW rows, knob fold_qk_norm):
// QK_NORM_ROPE's math (amk_group_norm_rope, the same bits) on the group's G RAW q rows (the task's q slot) into o_s
// (fp32 [G, D], read by the bodies through amk_attn_ldq), and with append_k (the task whose keys end at pos) on the
// group's RAW K row into the cache row at pos (slot s_out + 1, the k_cache buffer), before any of the block's reads
// of that row. The norm weights and inv_freq (constants) load before the task's deferred wait, the producers' rows
// after it (amk_join; the bodies' own amk_join then returns at once). Ends with a block barrier. Returns the
// finished q rows (o_s), or null: the block stops (abort, timeout, or BAD_INPUT: the scratch does not fit).
__device__ __noinline__ const float* amk_attn_fold_qk(const AmkCtx& c, const AmkAttnRange& r, bool partial,
                                                      bool appk, int s_out) {
  const int G = r.G, D = r.D, half = D >> 1, tid = amk_tid();
  const AmkAttnSmem m = amk_attn_smem(G, D);
  if (!amk_attn_fold_fits(m, D)) {
    if (tid == 0) amk_fail(c, AMK_ERR_BAD_INPUT, D);
    return nullptr;
  }
  const int s = AMK_ATTN_DECODE_N_REQUIRED_IN;  // q_norm_w, inv_freq, then (append_k) k_raw, k_norm_w
  float* sm = amk_in_smem(c.smem);
  float* ys = sm;           // [G, D] the RAW q rows (q_s)
  float* qo = sm + m.o;     // [G, D] the finished q rows (o_s)
  float* ks = sm + m.sc;    // [D] the RAW K row | q_norm_w [D] | inv_freq [D/2] | k_norm_w [D], all fp32
  float* qw = ks + D;
  float* fr = qw + D;
  float* kw = fr + half;
  const void* qwp = amk_ptr(c, s);
  const void* frp = amk_ptr(c, s + 1);
  const void* kwp = appk ? amk_ptr(c, s + 3) : nullptr;
  const int qw_dt = amk_dtype(c, s), fr_dt = amk_dtype(c, s + 1), kw_dt = appk ? amk_dtype(c, s + 3) : 0;
  for (int i = tid; i < D + half + (appk ? D : 0); i += AMK_THREADS) {  // (k_norm_w only with append_k)
    if (i < D) qw[i] = amk_ldw(qwp, qw_dt, i);
    else if (i < D + half) qw[i] = amk_ldw(frp, fr_dt, i - D);
    else qw[i] = amk_ldw(kwp, kw_dt, i - D - half);
  }
  if (!amk_join(c)) return nullptr;  // a joined task (sync.cuh) waits here for the QKV tasks' RAW rows
  const float* q_raw = (const float*)amk_ptr(c, AMK_ATTN_DECODE_IN_Q) + (int64_t)r.kvh * G * D;
  const float* k_raw = appk ? (const float*)amk_ptr(c, s + 2) + (int64_t)r.kvh * D : nullptr;
  const int nr = G * D + (appk ? D : 0);
  for (int i = tid; i < nr; i += AMK_THREADS) {
    if (i < G * D) ys[i] = __ldcg(q_raw + i);
    else ks[i - G * D] = __ldcg(k_raw + (i - G * D));
  }
  amk_sync();
  amk_group_norm_rope(ys, appk ? ks : nullptr, qw, kw, fr, G, D,
                      c.ins->fp[partial ? AMK_ATTN_PARTIAL_FP_QK_EPS : AMK_ATTN_DECODE_FP_QK_EPS], r.pos, qo,
                      appk ? amk_ptr(c, s_out + 1) : nullptr, appk ? amk_dtype(c, s_out + 1) : 0,
                      ((int64_t)r.kvh * r.S + r.pos) * D);
  __threadfence_block();  // the K row before the block's own cache reads of it (cp.async, after the barrier)
  amk_sync();
  return qo;
}
