// Tensor-core decode attention: the fast path of amk_op_attn (ops_attention.cuh) for 2-byte KV caches (bf16,
// f16), head_dim 64 or 128 and GQA groups of at most 8 heads. Same contract as the generic path: st = (m, l) and
// o_s (unnormalised) over keys [lo, hi), ending with a barrier -- or, given the task's output rows (AMK_ATTN_DIRECT),
// those rows written directly with the same values and no closing barrier.
//
// Why: the generic path computes scores and P.V with fp32 FMAs from shared memory and is instruction-bound at long
// context (~2 us per 128-key tile on an H100 while its bytes need ~1.4 us; docs/PERF.md, fifth session).
// Here one 16-key chunk costs D/16 ldmatrix + D/8 mma for the scores and the same for P.V. On llama-3.2-1b at ctx
// 32768 that was 16% faster than the generic path (interleaved A/B), and the copy changes below 5% more
// (docs/PERF.md, eighth session).
//
// Data flow:
//   * tiles of KT keys stream through the same AMK_ATTN_STAGES cp.async stages (K rows, then V rows at KT rows),
//     but 16-byte chunk c of row r lands at chunk c ^ (r & 7) of its row (XOR swizzle): the 8 row addresses of one
//     ldmatrix then hit 8 different bank groups;
//   * chunk i of 16 keys (counted over the whole task) belongs to warp i % NWARPS, which keeps its own online-
//     softmax state (m, l, O) in registers across tiles:
//       S[16 x 16] = Q[16 x D] . K^T          mma m16n8k16; Q rows = the G heads, rows G..15 zero
//       p = 2^(s * scale * log2 e - m)        per head row = one quad of lanes (ex2.approx); p rounded to T
//       O[16 x D] = O * alpha + P . V          V through ldmatrix.trans
//     Only rows 0..7 of the M = 16 tile are real (G <= 8): the A registers of rows 8..15 are zero and their
//     accumulators are dropped;
//   * at the end the warps' (m, l, O) are merged in fixed warp order through shared memory (O in the stage area,
//     m and l in the score area), so reruns are bit-identical.
// Rounding: q and p are rounded to the cache type before the MMA (as a bf16 SDPA does); l sums the rounded p, so
// the output stays a convex combination of V rows. Scores, softmax state and O accumulate in fp32.
#pragma once
#include "common.cuh"
#include "sync.cuh"

// AMK_ATTN_MMA (attn_common.cuh): 0 compiles this path out.

// (lo, hi) rounded to nearest into one packed pair (one cvt instruction), lo in the low half.
__device__ __forceinline__ uint32_t amk_pack2(AmkBF16, float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t amk_pack2(AmkF16, float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 2^x on the special-function unit (~2 ulp; 2^-inf = 0). p is rounded to 8 or 11 bits right after.
__device__ __forceinline__ float amk_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// The two values of a packed pair as the MMA sees them.
__device__ __forceinline__ float amk_pair_sum(AmkBF16, uint32_t w) {
  return __uint_as_float(w << 16) + __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ float amk_pair_sum(AmkF16, uint32_t w) { return amk_f16_bits(w & 0xffffu) + amk_f16_bits(w >> 16); }

// d[0..1] += rows 0..7 of A[16 x 16] . B[16 x 8]: a0 = (row g, k 2t..2t+1), a2 = (row g, k 8+2t..) as packed
// pairs, rows 8..15 of A zero; b0 / b1 = (k 2t.., n g) / (k 8+2t.., n g); d = (row g, n 2t..2t+1). One overload
// per element type TAG with PTX type name PTX.
#define AMK_MMA_ROWS8(TAG, PTX)                                                                                 \
  __device__ __forceinline__ void amk_mma_rows8(TAG, float (&d)[2], uint32_t a0, uint32_t a2, uint32_t b0,    \
                                                uint32_t b1) {                                                \
    asm("{\n.reg .f32 x2, x3;\n"                                                                               \
        "mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,x2,x3}, {%2,%3,%4,%5}, {%6,%7}, "     \
        "{%0,%1,%8,%9};\n}"                                                                                    \
        : "+f"(d[0]), "+f"(d[1])                                                                              \
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f), "f"(0.f));                          \
  }
AMK_MMA_ROWS8(AmkBF16, "bf16")
AMK_MMA_ROWS8(AmkF16, "f16")
#undef AMK_MMA_ROWS8

// Four 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void amk_ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void amk_ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// Build switches, defaults measured on an H100 (docs/PERF.md, eighth session; llama-3.2-1b ctx 32768):
//   AMK_ATTN_ONEBAR  1: one barrier per tile, the stage refill issued after the barrier that publishes the tile
//                    (-1.1% vs 0: refill before the wait, a second barrier after the math);
//   AMK_ATTN_CP_HINT 1: KV copies with an L2 evict-first policy (-5.5% vs 0: no hint; 2: 256-byte L2 prefetch, -1.4%).
#ifndef AMK_ATTN_ONEBAR
#define AMK_ATTN_ONEBAR 1
#endif
static_assert(!AMK_ATTN_ONEBAR || AMK_ATTN_STAGES >= 2, "AMK_ATTN_ONEBAR needs at least 2 attention stages");
#ifndef AMK_ATTN_CP_HINT
#define AMK_ATTN_CP_HINT 1
#endif
//   AMK_ATTN_QFIRST  1: q loads issued before the first KV tile copies (0: after them, the eighth session's order).
#ifndef AMK_ATTN_QFIRST
#define AMK_ATTN_QFIRST 1
#endif
//   AMK_ATTN_FILL    1: the prologue issues tiles 0..STAGES-1 (every stage); 0: tiles 0..STAGES-2, tile STAGES-1
//                    after the first barrier (i.e. after q has landed), the order before the fourteenth session.
#ifndef AMK_ATTN_FILL
#define AMK_ATTN_FILL 1
#endif
constexpr int AMK_ATTN_PRO = AMK_ATTN_STAGES - 1 + (AMK_ATTN_FILL ? 1 : 0);  // tiles issued by the prologue
//   AMK_ATTN_ONESHOT 1: a task whose tiles all fit the prologue (nt <= AMK_ATTN_PRO: every split at ctx 512) waits
//                    for all of them once and runs them with no barrier in between, so consecutive tiles' chunks
//                    (which belong to different warps) run at the same time; 0: one barrier per tile, as at long
//                    context. The chunk -> warp map and every sum's order are the same: the bits are too.
#ifndef AMK_ATTN_ONESHOT
#define AMK_ATTN_ONESHOT 1
#endif
// One 16-byte KV copy into the swizzled stage (pol: the evict-first policy when AMK_ATTN_CP_HINT is 1).
__device__ __forceinline__ void amk_cp_kv16(void* dst_smem, const void* src, uint64_t pol) {
  const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst_smem);
  if (AMK_ATTN_CP_HINT == 1)
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "l"(pol)
                 : "memory");
  else if (AMK_ATTN_CP_HINT == 2)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// Whether the fast path takes a task: KT keys per tile (a multiple of 16); the per-warp m and l fit the score
// area (G * KT floats), the per-warp O the stage area, and the q fragments (16 * D bytes) the P.V-partials area.
__device__ __forceinline__ bool amk_attn_mma_ok(int G, int D, int KT) {
  return AMK_ATTN_MMA && (D == 64 || D == 128) && G >= 1 && G <= 8 && KT % 16 == 0 && KT >= 2 * AMK_NWARPS &&
         AMK_NWARPS * G * D * 4 <= AMK_ATTN_STAGES * AMK_ATTN_STAGE_BYTES &&
         amk_attn_rg(D) * (G < AMK_ATTN_GB ? G : AMK_ATTN_GB) >= 4;
}
// Whether amk_op_attn takes the fast path for a 2-byte cache whose head rows start at kbase / vbase (16-byte
// aligned rows). amk_attn_early asks the same question before the wait.
__device__ __forceinline__ bool amk_attn_mma_takes(int G, int D, const char* kbase, const char* vbase) {
  return (D * 2) % 16 == 0 && amk_aligned16(kbase) && amk_aligned16(vbase) && amk_attn_mma_ok(G, D, amk_attn_keys(D, 2));
}

// Rows [ra, rb) of tile t (its first key's K / V rows at kg / vg) into stage t % STAGES, chunk c of row r at chunk
// c ^ (r & 7); threads i0, i0 + step, ... take one 16-byte chunk of K and the same chunk of V each.
template <int D>
__device__ __forceinline__ void amk_attn_mma_rows(char* kv, int t, int KT, const char* kg, const char* vg, int ra,
                                                  int rb, int i0, int step, uint64_t pol) {
  constexpr int ROW = D * 2, CPR = D / 8;
  char* ks = kv + (t % AMK_ATTN_STAGES) * AMK_ATTN_STAGE_BYTES;
  char* vs = ks + KT * ROW;
  for (int i = ra * CPR + i0; i < rb * CPR; i += step) {
    const int r = i / CPR, off = r * ROW + (((i - r * CPR) ^ (r & 7)) << 4);
    amk_cp_kv16(ks + off, kg + i * 16, pol);
    amk_cp_kv16(vs + off, vg + i * 16, pol);
  }
}

// q: this KV head's G query rows [G, D] (fp32, global; or shared: a folded QK-norm's, amk_attn_ldq); kbase /
// vbase: its cache rows [S, D] (16-byte aligned).
// o_s [G, D], st [(m, l) x G], sc (score area), qf (the P.V-partials area) and kv (stage area): the op's
// shared-memory areas (amk_attn_smem).
// cut: rows [lo, cut) of the first AMK_ATTN_STAGES tiles are already in flight (amk_attn_early; lo = none).
// out (AMK_ATTN_DIRECT): the task's output rows in global memory, written straight from the cross-warp merge with
// the values the op's own loop would write from o_s / st -- ATTN_PARTIAL (partial): [G, (m, l, o[D])]; ATTN_DECODE:
// o / l as [G, D] -- and the body then ends without a barrier (the task loop's follows). Null: o_s and st, then a
// barrier.
template <class T, int D>
__device__ __noinline__ void amk_attn_mma(const AmkCtx& c, const float* q, const char* kbase, const char* vbase,
                                          int G, int lo, int hi, int cut, float scale, float* o_s, float* st,
                                          float* sc, uint2* qf, char* kv, float* out, bool partial) {
  constexpr int ROW = D * 2, CPR = D / 8, KSTEPS = D / 16, NT = D / 8;  // row bytes, 16-byte chunks, k-steps, n-tiles
  const int KT = amk_attn_keys(D, 2), CPT = KT / 16;                     // keys and 16-key chunks per tile
  const int tid = amk_tid(), warp = amk_warp(), lane = amk_lane();
  const int g = lane >> 2, tq = lane & 3;  // this lane's head row and quad position in the mma fragments
  const bool gv = g < G;
  const int nt = hi > lo ? (hi - lo + KT - 1) / KT : 0;
  const uint64_t pol = AMK_ATTN_CP_HINT == 1 ? amk_policy_evict_first() : 0;
  auto issue = [&](int t) {  // tile t -> stage t % STAGES, swizzled; one commit group per tile (empty past the end)
    if (t < nt && !AMK_DBG_NOLOAD) {
      const int t0 = lo + t * KT, tn = (hi - t0) < KT ? (hi - t0) : KT;
      const int ra = t < AMK_ATTN_STAGES ? AMK_CLAMP(cut - t0, 0, tn) : 0;  // rows issued before the wait
      amk_attn_mma_rows<D>(kv, t, KT, kbase + (size_t)t0 * ROW, vbase + (size_t)t0 * ROW, ra, tn, tid, AMK_THREADS,
                           pol);
      char* vs = kv + (t % AMK_ATTN_STAGES) * AMK_ATTN_STAGE_BYTES + KT * ROW;
      // V rows [tn, 16-key boundary) of a short tile: p is 0 there, but 0 * a stale NaN would not be
      const int tz = (tn + 15) & ~15;
      for (int i = tn * CPR + tid; i < tz * CPR; i += AMK_THREADS) *(uint4*)(vs + i * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
    amk_cp_async_commit();
  };
  // q rows as A fragments (rounded to T) in shared memory, fragment order [k-step][lane] (8 bytes each: the
  // row-g pairs of k 2tq.. and 8+2tq..); re-read per chunk (registers are kept for O). With one k-step per warp
  // (AMK_ATTN_QFIRST) the q loads are issued before the first KV tiles: loads an SM issues after a batch of
  // others wait behind them (docs/PERF.md, ninth session), and q is on the critical path, the tiles are not.
  auto q_load = [=](int s, bool v, float2& x, float2& y) {  // k-step s of head row g: elements 2tq.. and 8+2tq..
    x = make_float2(0.f, 0.f), y = x;
    if (v) {
      x = amk_attn_ldq2((const float2*)(q + g * D + 16 * s + 2 * tq));
      y = amk_attn_ldq2((const float2*)(q + g * D + 16 * s + 8 + 2 * tq));
    }
  };
  auto q_store = [=](int s, float2 x, float2 y) {
    qf[s * 32 + lane] = make_uint2(amk_pack2(T(), x.x, x.y), amk_pack2(T(), y.x, y.y));
  };
  // A joined task (sync.cuh) waits for its q and its new K / V row here, after the setup above.
  if (!amk_join(c)) return;
  // The prologue fills every stage (all are free when the op starts): tile STAGES - 1 -- for a short split the
  // one holding the row at pos -- is then in flight with q instead of issued after q has landed.
  if (AMK_DBG_ATTN_STAGE_MARKS) amk_mark(c, 2);
  if constexpr (AMK_ATTN_QFIRST && KSTEPS <= AMK_NWARPS) {
    float2 x, y;
    q_load(warp, gv && warp < KSTEPS, x, y);
    for (int t = 0; t < AMK_ATTN_PRO; ++t) issue(t);
    if (AMK_DBG_ATTN_STAGE_MARKS) amk_mark(c, 3);
    if (warp < KSTEPS) q_store(warp, x, y);
  } else {
    for (int t = 0; t < AMK_ATTN_PRO; ++t) issue(t);  // q is read while the first tiles are in flight
#pragma unroll
    for (int s = warp; s < KSTEPS; s += AMK_NWARPS) {
      float2 x, y;
      q_load(s, gv, x, y);
      q_store(s, x, y);
    }
  }
  amk_mark(c, 1);
  float o[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = 0.f;
  float m = -INFINITY, l = 0.f;  // running max (log2 units of the scaled scores) and this lane's part of the sum
  const float sl2 = scale * 1.4426950408889634f;
  const uint32_t kv_s = (uint32_t)__cvta_generic_to_shared(kv);
  // this lane's ldmatrix row inside a 16-key chunk and its chunk-XOR, for K (no trans) and V (trans)
  const int krow = ((lane >> 4) << 3) + (lane & 7), kx = ((lane >> 3) & 1) ^ (lane & 7);
  const int vrow = (((lane >> 3) & 1) << 3) + (lane & 7), vx = (lane >> 4) ^ (lane & 7);
  // no stage is refilled: one wait, one barrier (AMK_ATTN_ONESHOT 2, A/B builds only: the code is compiled but a
  // run-time test that never holds keeps it off, to separate its effect from the code layout's)
  const bool oneshot = AMK_ATTN_ONESHOT && nt <= AMK_ATTN_PRO && (AMK_ATTN_ONESHOT != 2 || c.p->n_queues < 0);
  if (oneshot) {
    amk_cp_async_wait<0>();
    amk_sync();
  }
  for (int t = 0; t < nt; ++t) {
    // tile t + STAGES - 1 is issued here unless the prologue did (it issued tiles 0..PRO-1); groups committed
    // before the ONEBAR wait: PRO, plus one per earlier iteration that issued; tile t is the (t+1)-th oldest
    const bool refill = t + AMK_ATTN_STAGES - 1 >= AMK_ATTN_PRO;
    if (!oneshot) {
#if AMK_ATTN_ONEBAR
      if (AMK_ATTN_FILL && t == 0) amk_cp_async_wait<AMK_ATTN_STAGES - 1>();
      else amk_cp_async_wait<AMK_ATTN_STAGES - 2>();
      amk_sync();  // tile t landed, and every warp is done with tile t - 1: its stage takes tile t + STAGES - 1
      if (refill) issue(t + AMK_ATTN_STAGES - 1);
#else
      if (refill) issue(t + AMK_ATTN_STAGES - 1);
      amk_cp_async_wait<AMK_ATTN_STAGES - 1>();
      amk_sync();
#endif
    }
    const int t0 = lo + t * KT, tn = (hi - t0) < KT ? (hi - t0) : KT, nch = (tn + 15) >> 4;
    const uint32_t ks = kv_s + (t % AMK_ATTN_STAGES) * AMK_ATTN_STAGE_BYTES, vs = ks + KT * ROW;
    int i = (warp - (t * CPT) % AMK_NWARPS + AMK_NWARPS) % AMK_NWARPS;  // chunk t*CPT + i is this warp's
    for (; i < nch && !AMK_DBG_NOCOMPUTE; i += AMK_NWARPS) {
      const int r0 = i * 16;
      // (1) scores of keys r0 + 2tq.. (s[0], s[1]) and r0 + 8 + 2tq.. (s[2], s[3]) for head row g
      float s0[2] = {0.f, 0.f}, s1[2] = {0.f, 0.f};
      const uint32_t kaddr = ks + (r0 + krow) * ROW;
#pragma unroll
      for (int s = 0; s < KSTEPS && !(AMK_DBG_SKIP & 1); ++s) {
        uint32_t b[4];
        amk_ldsm_x4(b, kaddr + (((2 * s) ^ kx) << 4));
        const uint2 qv = qf[s * 32 + lane];
        amk_mma_rows8(T(), s0, qv.x, qv.y, b[0], b[1]);
        amk_mma_rows8(T(), s1, qv.x, qv.y, b[2], b[3]);
      }
      float sv[4] = {s0[0] * sl2, s0[1] * sl2, s1[0] * sl2, s1[1] * sl2};
      const int kk = r0 + 2 * tq;
      if (kk >= tn) sv[0] = -INFINITY;
      if (kk + 1 >= tn) sv[1] = -INFINITY;
      if (kk + 8 >= tn) sv[2] = -INFINITY;
      if (kk + 9 >= tn) sv[3] = -INFINITY;
      // (2) online softmax over the quad that holds row g
      float alpha = 1.f;
      uint32_t p0 = 0x3f803f80u, p1 = p0;  // profiling (AMK_DBG_SKIP & 2) only: p = 1 (bf16)
      if (!(AMK_DBG_SKIP & 2)) {
        float mx = fmaxf(fmaxf(sv[0], sv[1]), fmaxf(sv[2], sv[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m, mx), base = m_new == -INFINITY ? 0.f : m_new;
        alpha = amk_ex2(m - base);
        p0 = amk_pack2(T(), amk_ex2(sv[0] - base), amk_ex2(sv[1] - base));
        p1 = amk_pack2(T(), amk_ex2(sv[2] - base), amk_ex2(sv[3] - base));
        l = l * alpha + (amk_pair_sum(T(), p0) + amk_pair_sum(T(), p1));
        m = m_new;
      }
      // (3) O = O * alpha + P . V, two 8-dim n-tiles per ldmatrix.trans
      const uint32_t vaddr = vs + (r0 + vrow) * ROW;
#pragma unroll
      for (int j = 0; j < NT / 2 && !(AMK_DBG_SKIP & 4); ++j) {
        uint32_t b[4];
        amk_ldsm_x4_t(b, vaddr + (((2 * j) ^ vx) << 4));
        o[2 * j][0] *= alpha;
        o[2 * j][1] *= alpha;
        o[2 * j + 1][0] *= alpha;
        o[2 * j + 1][1] *= alpha;
        amk_mma_rows8(T(), o[2 * j], p0, p1, b[0], b[1]);
        amk_mma_rows8(T(), o[2 * j + 1], p0, p1, b[2], b[3]);
      }
    }
#if !AMK_ATTN_ONEBAR
    if (!oneshot) amk_sync();  // the stage may be refilled
#endif
  }
  amk_cp_async_wait<0>();
  amk_sync();
  // merge the warps: O_w -> stage area [NWARPS][G][D], (m_w, l_w) -> score area [NWARPS][G] x 2. Only the first
  // nwa warps got a chunk (chunks are numbered from 0 over the task, chunk i on warp i % NWARPS); the others hold
  // m = -inf, l = 0, O = 0, which add nothing to the merge below, so they are left out (same bits).
  const int tot = nt > 0 ? (nt - 1) * CPT + ((hi - (lo + (nt - 1) * KT) + 15) >> 4) : 0;
  const int nwa = tot < AMK_NWARPS ? tot : AMK_NWARPS;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  float* ow = (float*)kv;
  float* mw = sc;
  float* lw = sc + AMK_NWARPS * G;
  if (gv && warp < nwa) {
#pragma unroll
    for (int n = 0; n < NT; ++n) *(float2*)(ow + (warp * G + g) * D + 8 * n + 2 * tq) = make_float2(o[n][0], o[n][1]);
    if (tq == 0) {
      mw[warp * G + g] = m;
      lw[warp * G + g] = l;
    }
  }
  amk_sync();
  for (int idx = tid; idx < G * D; idx += AMK_THREADS) {
    const int h = idx / D, d = idx - h * D;
    float mm = -INFINITY;
    for (int w = 0; w < nwa; ++w) mm = fmaxf(mm, mw[w * G + h]);
    float os = 0.f, ls = 0.f;
    for (int w = 0; w < nwa; ++w) {
      const float mv = mw[w * G + h], wt = mv == -INFINITY ? 0.f : amk_ex2(mv - mm);
      os = fmaf(wt, ow[(w * G + h) * D + d], os);
      ls = fmaf(wt, lw[w * G + h], ls);
    }
    const float mn = mm == -INFINITY ? -INFINITY : mm * 0.6931471805599453f;  // natural units of score * scale
    if (out != nullptr) {
      amk_attn_store(out, partial, D, h, d, os, mn, ls);
    } else {
      o_s[idx] = os;
      if (d == 0) {
        st[h] = mn;
        st[G + h] = ls;
      }
    }
  }
  if (out == nullptr) amk_sync();
}

// Rows [lo, pos) of the first AMK_ATTN_STAGES tiles of the task with keys r, cache bases kbase / vbase, into the
// stage area kv, by threads [t_first, AMK_THREADS); one cp.async group per thread, which the op's first wait_group
// covers (it is the oldest group the thread has). Only where the fast path takes the task and pos is inside the
// cache (the op's own test, so the op's cut = pos holds exactly when this issued).
__device__ __forceinline__ void amk_attn_issue_history(const AmkAttnRange& r, int dt, const char* kc, const char* vc,
                                                       char* kv, int t_first) {
  const bool two = (AMK_HAS_DTYPE(AMK_DTYPE_BF16) && dt == AMK_DTYPE_BF16) ||
                   (AMK_HAS_DTYPE(AMK_DTYPE_F16) && dt == AMK_DTYPE_F16);
  if (AMK_DBG_NOLOAD || !two || !r.ok || !r.early) return;
  const int D = r.D, row = D * 2;
  const char* kbase = kc + (size_t)r.kvh * r.S * row;
  const char* vbase = vc + (size_t)r.kvh * r.S * row;
  if (!amk_attn_mma_takes(r.G, D, kbase, vbase)) return;
  const int KT = amk_attn_keys(D, 2), i0 = amk_tid() - t_first, step = AMK_THREADS - t_first;
  const uint64_t pol = AMK_ATTN_CP_HINT == 1 ? amk_policy_evict_first() : 0;
  for (int t = 0, t0 = r.lo; t < AMK_ATTN_STAGES && t0 < r.hi; ++t, t0 += KT) {
    const int tn = (r.hi - t0) < KT ? (r.hi - t0) : KT, rb = AMK_CLAMP(r.pos - t0, 0, tn);
    if (D == 64) amk_attn_mma_rows<64>(kv, t, KT, kbase + (size_t)t0 * row, vbase + (size_t)t0 * row, 0, rb, i0, step, pol);
    else amk_attn_mma_rows<128>(kv, t, KT, kbase + (size_t)t0 * row, vbase + (size_t)t0 * row, 0, rb, i0, step, pol);
  }
  amk_cp_async_commit();
}

// The KV copies of an ATTN_DECODE / ATTN_PARTIAL task with the early_kv hint 1 that need not wait, issued BEFORE its
// wait by threads [t_first, AMK_THREADS) once the task's slots are resolved (megakernel.cu); the op then issues the
// rest (amk_attn_mma's cut = pos).
// The hint pays where the SM is idle before the task's inputs are ready (the rows land meanwhile); right behind a
// QKV task of its own group it measured 1.4% slower (the copies are still in flight when q's load is issued).
// Why this is safe before the wait: no task of a step writes a cache row other than pos -- every KV_CACHE writer
// (QKV_ROPE K / V tiles, QK_NORM_ROPE) appends the row at pos (schedule/ops.py; the validator models cache accesses
// as (head, column) of that row) -- so rows < pos are final since the launches that wrote them.
__device__ __noinline__ void amk_attn_early(const AmkCtx& c, int t_first) {
  const AmkAttnRange r = amk_attn_range(c, c.ins->op == AMK_OP_ATTN_PARTIAL);
  amk_attn_issue_history(r, amk_dtype(c, AMK_ATTN_DECODE_IN_K_CACHE),
                         (const char*)amk_ptr(c, AMK_ATTN_DECODE_IN_K_CACHE),
                         (const char*)amk_ptr(c, AMK_ATTN_DECODE_IN_V_CACHE),
                         amk_attn_kv(c, amk_in_smem(c.smem), amk_attn_smem(r.G, r.D)), t_first);
}

// early_kv 2 (AMK_KV_AHEAD builds): the task at queue position qpos -- the NEXT task of this block's queue, an
// attention task -- gets its KV history rows issued by the task before it (flag AMK_INSTR_FLAG_KV_AHEAD), from
// that task's start, by threads [t_first, AMK_THREADS) while its thread 0 waits: the rows land while the block
// runs the task before (at long context a QKV task, whose phase leaves the HBM at ~2 TB/s). The stages are the
// region at the top of shared memory that no other op uses (amk_attn_kv_top). The next instruction and its
// buffers are read from global memory here (its slots are resolved only when it runs). Same rows and the same
// safety argument as amk_attn_early; the op's first wait_group covers these groups too (they are each thread's
// oldest: the task in between issues no cp.async -- the loader flags only such tasks).
#if AMK_KV_AHEAD
__device__ __noinline__ void amk_kv_ahead(const AmkParams& p, int qpos, int t_first) {
  const AmkInstr& in = p.instrs[__ldg(p.queue_items + qpos)];
  if (amk_attn_early_value(in) != 2) return;  // (0 for any op but attention: the loader flags only early_kv 2)
  const AmkBufDesc kd = p.bufs[__ldg(&in.buf[AMK_ATTN_DECODE_IN_K_CACHE])];
  const AmkBufDesc vd = p.bufs[__ldg(&in.buf[AMK_ATTN_DECODE_IN_V_CACHE])];
  const AmkBufDesc pd = p.bufs[__ldg(&in.buf[AMK_ATTN_DECODE_IN_POS])];
  const AmkAttnRange r = amk_attn_range_of(in, amk_io_value(p, (const int*)(uintptr_t)pd.ptr),
                                           __ldg(&in.op) == AMK_OP_ATTN_PARTIAL);
  amk_attn_issue_history(r, kd.dtype, (const char*)(uintptr_t)kd.ptr, (const char*)(uintptr_t)vd.ptr,
                         amk_attn_kv_top(p), t_first);
}
#endif
