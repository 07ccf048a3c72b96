// GEMV tiles (optional fused RMSNorm on the input, bias, residual) and the streaming loops every weight-streaming
// op shares (the MLP tiles of ops_mlp.cuh, the QKV tiles of ops_qkv.cuh).
//
//   GEMV:          y[r] = (W[r,:] . f(x) + bias[r]) + residual[r]         for r in [r0, r0+rn)
//                  (has_argmax: also the tile's (max, row index) pair, for ARGMAX_PAIRS)
//   f(x) = rmsnorm(x) * norm_w if has_norm else x; x: fp32 [K] (staged in smem once per task, as x * norm_w: the
//   1/rms scale multiplies the finished dot products, see amk_stage_x).
//   GEMV with x_splits > 0 (o_proj after split-KV attention): x is the online-softmax merge of the attention
//   partials, computed while staging (amk_stage_merged_x), so no ATTN_MERGE task sits between attention and o_proj.
//
// Streaming: each warp owns whole rows; lanes read consecutive 16-byte chunks (a warp reads 512 contiguous bytes
// per load), R rows x U chunks per lane are in flight before the first FMA (~64 KB per block). When a tile has
// fewer rows than warps, several warps split one row's K range and their partials are summed in warp order.
// Odd K (K % (16/elem) != 0) takes a scalar path. Every row's sum has a fixed order: results are bit-reproducible.
#pragma once
#include "common.cuh"
#include "ops_embed_norm.cuh"
#include "attn_common.cuh"  // amk_attn_merge_elem (the o_proj tasks that merge)
#include "stream.cuh"
#include "preload.cuh"

// xf = x of 16-byte weight chunk cc (of nc per row): 2-byte weights read the split layout (amk_x_split: the vec
// path has K % 8 == 0; the halves are nc float4s apart).
template <class T>
__device__ __forceinline__ void amk_x_chunk(const float* __restrict__ xs, int nc, int cc, float (&xf)[T::VE]) {
  constexpr bool split = AMK_X_SPLIT && T::BYTES == 2;
  const float4* x4 = (const float4*)xs + (split ? cc : cc * (T::VE / 4));
#pragma unroll
  for (int q = 0; q < T::VE / 4; ++q) {
    const float4 t = x4[split ? q * nc : q];
    xf[4 * q] = t.x; xf[4 * q + 1] = t.y; xf[4 * q + 2] = t.z; xf[4 * q + 3] = t.w;
  }
}

// acc += (one chunk of weights w) . xf, element by element in order.
template <class T>
__device__ __forceinline__ void amk_fma_chunk(const uint4& w, const float (&xf)[T::VE], float& acc) {
  float wf[T::VE];
  T::unpack(w, wf);
#pragma unroll
  for (int e = 0; e < T::VE; ++e) acc = fmaf(wf[e], xf[e], acc);
}

// acc[u] = (chunk u of this lane's RS rows, v[u]) . (x chunk cc), each from zero; lanes past the row (cc >= nc)
// get zeros. The per-lane step of the short-row paths (amk_short_rows, amk_gemv_group_body).
template <class T, int RS>
__device__ __forceinline__ void amk_fma_rows(const uint4 (&v)[RS], const float* xs, int nc, int cc, float (&acc)[RS]) {
#pragma unroll
  for (int u = 0; u < RS; ++u) acc[u] = 0.f;
  if (cc < nc) {
    float xf[T::VE];
    amk_x_chunk<T>(xs, nc, cc, xf);
#pragma unroll
    for (int u = 0; u < RS; ++u) amk_fma_chunk<T>(v[u], xf, acc[u]);
  }
}

// acc[r] += sum over this lane's chunks c0, c0+cstep, ... < nc of rows[r][chunk] . xs[chunk]
// Src: AmkSrcGlobal (ld.global.nc, evict-first) or AmkSrcShared (rows staged in the weight ring).
template <class T, int R, int U, class Src>
__device__ __forceinline__ void amk_dot_vec(const char* const (&rows)[R], const float* __restrict__ xs, int nc,
                                            int c0, int cstep, const Src& src, float (&acc)[R]) {
  for (int c = c0; c < nc; c += cstep * U) {
    uint4 v[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * cstep;
#pragma unroll
      for (int r = 0; r < R; ++r)
        v[r][u] = cc < nc ? src.ld(rows[r] + (size_t)cc * 16) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * cstep;
      if (cc < nc) {
        float xf[T::VE];
        amk_x_chunk<T>(xs, nc, cc, xf);
#pragma unroll
        for (int r = 0; r < R; ++r) amk_fma_chunk<T>(v[r][u], xf, acc[r]);
      }
    }
  }
}

// Scalar fallback: elements e0, e0+estep, ... < K (x in the split layout where amk_x_split says so).
template <class T, int R>
__device__ __forceinline__ void amk_dot_scalar(const char* const (&rows)[R], const float* __restrict__ xs, int K,
                                               int e0, int estep, float (&acc)[R]) {
  constexpr int U = 4;
  const bool split = amk_x_split(T::BYTES, K);
  for (int e = e0; e < K; e += estep * U) {
    float w[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ee = e + u * estep;
#pragma unroll
      for (int r = 0; r < R; ++r) w[r][u] = ee < K ? T::ro(rows[r], ee) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ee = e + u * estep;
      if (ee < K) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(w[r][u], xs[amk_xpos(ee, K, split)], acc[r]);
      }
    }
  }
}

template <class T, int R, int U, class Src>
__device__ __forceinline__ void amk_dot(const char* const (&rows)[R], const float* xs, int K, bool vec, int lane0,
                                        int lstep, const Src& src, float (&acc)[R]) {
  if (vec) amk_dot_vec<T, R, U>(rows, xs, K / T::VE, lane0, lstep, src, acc);
  else amk_dot_scalar<T, R>(rows, xs, K, lane0, lstep, acc);  // global weights only (odd K is never streamed)
}

// Short rows (nc <= 32 16-byte chunks each, a vec tile): L = nc rounded up to a power of two lanes per row, 32 / L
// rows per warp load, RS loads per lane in flight (warp w takes rows w*RS*32/L.. of every block step). Per row
// the sum is the pair loop's: each lane's one chunk, then the butterfly over the row's lanes (the lanes the pair
// loop adds beyond them hold zeros), so the bits are the same. epi(r, acc[1]) once per row, by the row's first lane.
// has_pre: every thread runs pre() once, after its first loads are issued and before xs is read (pre ends with a
// block barrier: the fused MLP tile's wait for its h), so the weights' round trip overlaps it; every thread must
// call the function then. (amk_gemv_group_body keeps its own copy of this order: as a pre step of this loop its
// merged-input staging measured 2% slower on llama-3.2-1b, docs/PERF.md nineteenth session.)
template <class T, int RS, class Src, class Pre, class Epi>
__device__ __forceinline__ void amk_short_rows(const char* W, size_t rs, const float* xs, int nc, int rn,
                                               const Src& src, bool has_pre, Pre pre, Epi epi) {
  const int warp = amk_warp(), lane = amk_lane();
  int L = 1;
  while (L < nc) L <<= 1;
  const int rpi = 32 / L, sub = lane / L, cc = lane - sub * L;
  bool first = has_pre;
  for (int rb = warp * RS * rpi; rb < rn || first; rb += AMK_NWARPS * RS * rpi) {
    uint4 v[RS];
#pragma unroll
    for (int u = 0; u < RS; ++u) {
      int r = rb + u * rpi + sub;
      r = r < rn ? r : rn - 1;
      v[u] = cc < nc ? src.ld(W + (size_t)r * rs + (size_t)cc * 16) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (first) {
      pre();
      first = false;
      if (rb >= rn) break;
    }
    float acc[RS];
    amk_fma_rows<T, RS>(v, xs, nc, cc, acc);
    for (int o = L >> 1; o > 0; o >>= 1) {  // the RS rows' shuffles of one level are independent: issued together
#pragma unroll
      for (int u = 0; u < RS; ++u) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], o);
    }
    if (cc == 0) {
#pragma unroll
      for (int u = 0; u < RS; ++u) {
        const int r = rb + u * rpi + sub;
        const float a[1] = {acc[u]};
        if (r < rn) epi(r, a);
      }
    }
  }
}

// NM weight matrices (1 = GEMV, 2 = gate/up) with rn rows each, starting at byte pointers W[m] (row stride K elems).
// epi(r, acc[NM]) is called exactly once per row r in [0, rn) by one thread. No trailing barrier.
template <class T, int NM, class Src, class Epi>
__device__ __forceinline__ void amk_gemv_tile(const AmkCtx& c, const char* const (&W)[NM], int K, int rn,
                                              const float* xs, const Src& src, Epi epi) {
  const int warp = amk_warp(), lane = amk_lane();
  const size_t rs = (size_t)K * T::BYTES;
  bool vec = (K % T::VE) == 0;
#pragma unroll
  for (int m = 0; m < NM; ++m) vec = vec && amk_aligned16(W[m]);
  int wpr = rn > 0 ? AMK_NWARPS / rn : 1;  // warps per row
  if constexpr (NM == 1) {
    // Short rows (one 16-byte chunk per lane covers the row: o_proj split by KV group has K = group * head_dim, a
    // fused MLP tile's down block K = its rows): several rows per warp load, AMK_RS loads per lane in flight (the
    // pair loop below would take rn / 32 round trips with most lanes idle).
    if (vec && K / T::VE <= 32 && rn >= 2 * AMK_NWARPS) {
      amk_short_rows<T, AMK_RS>(W[0], rs, xs, K / T::VE, rn, src, false, [] {}, epi);
      return;
    }
  }
  if (wpr <= 1) {
    if constexpr (NM == 1) {
      for (int r = warp; r < rn; r += 2 * AMK_NWARPS) {  // warp-uniform: rows r and r + NWARPS together
        const int r2 = r + AMK_NWARPS;
        if (r2 < rn) {
          const char* rows[2] = {W[0] + r * rs, W[0] + r2 * rs};
          float acc[2] = {0.f, 0.f};
          amk_dot<T, 2, AMK_U2>(rows, xs, K, vec, lane, 32, src, acc);
          acc[0] = amk_warp_sum(acc[0]);
          acc[1] = amk_warp_sum(acc[1]);
          if (lane == 0) {
            const float a0[1] = {acc[0]}, a1[1] = {acc[1]};
            epi(r, a0);
            epi(r2, a1);
          }
        } else {
          const char* rows[1] = {W[0] + r * rs};
          float acc[1] = {0.f};
          amk_dot<T, 1, AMK_U1>(rows, xs, K, vec, lane, 32, src, acc);
          acc[0] = amk_warp_sum(acc[0]);
          if (lane == 0) epi(r, acc);
        }
      }
    } else {
      for (int r = warp; r < rn; r += AMK_NWARPS) {
        const char* rows[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) rows[m] = W[m] + r * rs;
        float acc[NM];
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m] = 0.f;
        amk_dot<T, NM, AMK_U2>(rows, xs, K, vec, lane, 32, src, acc);
#pragma unroll
        for (int m = 0; m < NM; ++m) acc[m] = amk_warp_sum(acc[m]);
        if (lane == 0) epi(r, acc);
      }
    }
  } else {
    // Split K: warp group g = warp / wpr owns row g; sub-warp `sub` takes chunks sub*32 + lane + k*32*wpr.
    const int g = warp / wpr, sub = warp - g * wpr;
    float acc[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] = 0.f;
    if (g < rn) {
      const char* rows[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) rows[m] = W[m] + g * rs;
      amk_dot<T, NM, (NM == 1 ? AMK_U1 : AMK_U2)>(rows, xs, K, vec, sub * 32 + lane, 32 * wpr, src, acc);
    }
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      acc[m] = amk_warp_sum(acc[m]);
      if (lane == 0) c.part[warp * NM + m] = acc[m];
    }
    amk_sync();
    const int r = amk_tid();
    if (r < rn) {
      float s[NM];
#pragma unroll
      for (int m = 0; m < NM; ++m) {
        s[m] = 0.f;
        for (int j = 0; j < wpr; ++j) s[m] += c.part[(r * wpr + j) * NM + m];
      }
      epi(r, s);
    }
  }
}

// Rows [0, g.rows) of a streamed task from the weight ring (stream.cuh). The task's work items are (row, K-slice)
// pairs in stage order: stage s holds rows [s*sr, s*sr + n_s), each cut into wpr slices (amk_stream_wpr), item
// j of stage s = (row s*sr + j / wpr, slice j % wpr); global item i goes to warp i % AMK_NWARPS. A warp waits for an
// item's stage itself (no block barrier per stage) and reports the item done (the stage's last item frees its
// slot). Each (row, matrix, slice) partial goes to stash[(r*NM + m)*wpr + slice]; after the last item one block
// barrier, then the partials are summed in fixed order and epi(r, acc[NM]) runs once per row.
// Returns false if the block must stop (abort flag set; the kernel loop stops the producer and exits).
template <class T, int NM, class Epi>
__device__ __forceinline__ bool amk_gemv_streamed(const AmkCtx& c, const AmkGeom& g, int K, const float* xs,
                                                  float* stash, Epi epi) {
  AmkRing& R = *c.ring;  // (R, ring and flag stay in registers across the items: see amk_ring_wait_warp)
  int* const flag = c.flag;
  const int warp = amk_warp(), lane = amk_lane();
  const int wpr = amk_stream_wpr(g), nc = K / T::VE;
  const int per_stage = g.sr * wpr, nst = (g.rows + g.sr - 1) / g.sr;
  const int n_items = g.rows * wpr;  // (only the last stage can be short; its items are the last ones)
  const uint32_t seq0 = R.consumed;  // all threads: stable since the last barrier
  const char* const ring = (const char*)c.ring_base;  // (held in a register across the items' waits)
  bool ok = true;
  int waited = -1;  // the last stage this warp waited for
  for (int i = warp; i < n_items; i += AMK_NWARPS) {
    const int s = i / per_stage, j = i - s * per_stage;
    const int n = (g.rows - s * g.sr) < g.sr ? (g.rows - s * g.sr) : g.sr;
    const uint32_t seq = seq0 + (uint32_t)s;
    if (s != waited) {
      if (!amk_ring_wait_warp(c, R, seq)) {
        if (lane == 0) *flag = 1;
        ok = false;
        break;
      }
      if (AMK_DBG_RING_STAMPS && waited < 0) amk_mark_lane0(c, 38 + warp);
      waited = s;
    }
    const int rr = j / wpr, sub = j - rr * wpr;
    const char* st = ring + (size_t)(seq % AMK_STAGES) * AMK_STAGE_BYTES;
    const char* rows[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) rows[m] = st + ((size_t)m * n + rr) * g.row_bytes;
    float acc[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) acc[m] = 0.f;
    amk_dot_vec<T, NM, AMK_RING_U>(rows, xs, nc, sub * 32 + lane, 32 * wpr, AmkSrcShared{}, acc);
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      acc[m] = amk_warp_sum(acc[m]);
      if (lane == 0) stash[((s * g.sr + rr) * NM + m) * wpr + sub] = acc[m];
    }
    amk_ring_item_done(R, seq, n * wpr);
  }
  if (AMK_DBG_RING_STAMPS) amk_mark_lane0(c, 6 + warp);
  amk_sync();  // every warp is past its items (and its stash writes are visible)
  if (*flag || !ok) return false;
  if (amk_tid() == 0) R.consumed = seq0 + (uint32_t)nst;  // (read after the task's barrier)
  for (int r = amk_tid(); r < g.rows; r += AMK_THREADS) {
    float a[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      a[m] = 0.f;
      for (int j = 0; j < wpr; ++j) a[m] += stash[(r * NM + m) * wpr + j];
    }
    epi(r, a);
  }
  return true;
}

// Rows [0, rn) of W (byte pointers W[m] at row 0), from the ring if the task streams, else straight from global.
// stash: the op's smem scratch of amk_stash_floats(g) floats (streamed tasks only).
// A task whose whole tile was preloaded (preload.cuh) runs the same tile over the preload buffer: matrix m starts
// at the sum of the earlier prefetch ranges, with the global row stride.
template <class T, int NM, class Epi>
__device__ __forceinline__ void amk_gemv_rows(const AmkCtx& c, const char* const (&W)[NM], int K, int rn,
                                              const float* xs, float* stash, Epi epi) {
  AmkGeom g;
  xs = amk_in_smem(xs);  // shared loads of x in the inner loop (see amk_in_smem; -1.5% on llama-3.2-1b)
  stash = amk_in_smem(stash);
#if AMK_PRE_DEVICE
  if (amk_pre_flagged(*c.ins) && c.pre->q == c.instr_index) {
    if (!amk_pre_wait(c)) return;
    const char* Ws[NM];
    int64_t off = 0;
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      Ws[m] = (const char*)c.pre_buf + off;
      off += c.ins->prefetch_bytes[m];
    }
    if (AMK_DBG_SETUP_MARK) amk_mark(c, 2);  // the preloaded rows are read from here
    amk_gemv_tile<T, NM>(c, Ws, K, rn, xs, AmkSrcShared{}, epi);
    if (!AMK_DBG_SETUP_MARK) amk_mark(c, 2);
    return;
  }
#endif
  if (AMK_DBG_SETUP_MARK) amk_mark(c, 2);  // the ring's rows are consumed / every register path's rows load from here
  if (amk_stream_geom(*c.ins, g)) amk_gemv_streamed<T, NM>(c, g, K, xs, stash, epi);
  else amk_gemv_tile<T, NM>(c, W, K, rn, xs, AmkSrcGlobal{amk_policy_evict_first()}, epi);
  if (!AMK_DBG_SETUP_MARK) amk_mark(c, 2);
}

// Per-dtype bodies are separate (noinline) functions: each gets its own register allocation.
// res_s: the task's residual rows staged in smem (null without residual).
// accumulate: y[r] += v with an atomic fp32 add (GEMV param accumulate; o_proj split by KV group).
// ycopy (GEMV has_copy, never with accumulate): the row's value also goes there.
// pair (GEMV has_argmax, never with accumulate): the tile's (max, row index as fp32) goes there, the first row on
// ties, a NaN counting as the maximum -- each row's epilogue thread keeps its best, then one block argmax.
template <class T>
__device__ __noinline__ void amk_gemv_body(const AmkCtx& c, const float* xs, int r0, int rn, int K,
                                           const char* wbase, const void* bias, int bias_dt, const float* res_s,
                                           AmkOut y, float* ycopy, float2* pair, float xr, bool accumulate) {
  const char* W[1] = {wbase + (size_t)r0 * K * T::BYTES};
  float bv = -INFINITY;
  int bi = INT_MAX;
  amk_gemv_rows<T, 1>(c, W, K, rn, xs, c.smem + amk_pad4(K), [&](int r, const float (&a)[1]) {
    float v = a[0] * xr;
    if (bias) v += amk_ldw(bias, bias_dt, r0 + r);
    if (res_s) v += res_s[r];
    if (accumulate) atomicAdd(amk_out_ptr(y) + r0 + r, v);
    else AMK_PUT(y, r0 + r, v);
    if (ycopy) ycopy[r0 + r] = v;
    if (pair && amk_argmax_better(v, r0 + r, bv, bi)) { bv = v; bi = r0 + r; }
  });
  if (pair) {
    amk_sync();  // every warp is past its rows (c.red / c.part are free for the block argmax)
    amk_argmax_block(c, bv, bi);
    if (amk_tid() == 0) *pair = make_float2(bv, (float)(bi == INT_MAX ? r0 : bi));
  }
}

// Elements of the attention-partials buffer a GEMV with x_splits > 0 merges into x, 0 otherwise (vm/smem.py:
// merged_x_floats).
__device__ __forceinline__ int amk_merged_x_floats(const AmkInstr& in) {
  const int ns = in.ip[AMK_GEMV_IP_X_SPLITS], G = in.ip[AMK_GEMV_IP_X_GROUP], D = in.ip[AMK_GEMV_IP_X_HEAD_DIM];
  if (in.op != AMK_OP_GEMV || ns <= 0 || G <= 0 || D <= 0) return 0;
  return in.ip[AMK_GEMV_IP_K] / (G * D) * ns * G * (D + 2);
}

// xs[0:K] = the merge of the split-KV attention partials part [K / (G*D), ns, G, D+2] (ATTN_MERGE's arithmetic,
// amk_attn_merge_elem: the same bits). The whole buffer is copied into ps first (16-byte cp.async when aligned: one
// round trip for all of it), then each thread merges its elements from shared memory. Ends with a barrier.
__device__ __forceinline__ void amk_stage_merged_x(const AmkCtx& c, const float* part, int K, int ns, int G, int D,
                                                   float* xs, float* ps, bool split) {
  xs = amk_in_smem(xs);
  ps = amk_in_smem(ps);
  const int GD = G * D, hrow = ns * G * (D + 2), n = K / GD * hrow;
  if ((n & 3) == 0 && amk_aligned16(part)) {
    for (int i = amk_tid(); i < (n >> 2); i += AMK_THREADS) amk_cp_async16((float4*)ps + i, (const float4*)part + i);
    amk_cp_async_commit();
    amk_cp_async_wait<0>();
  } else {
    for (int i = amk_tid(); i < n; i += AMK_THREADS) ps[i] = __ldcg(part + i);
  }
  amk_sync();
  for (int idx = amk_tid(); idx < K; idx += AMK_THREADS) {
    const int h = idx / GD, r = idx - h * GD, g = r / D;
    xs[amk_xpos(idx, K, split)] = amk_attn_merge_elem(ps + h * hrow, ns, G, D, g, r - g * D, AmkLdPlain{});
  }
  amk_sync();
  amk_mark(c, 1);
}

// o_proj split by KV group (x_splits > 0, short rows, accumulate, no bias / residual, weights from global): each
// warp's AMK_RS rows are issued into registers BEFORE the merged input is staged, so the weights' round trip
// overlaps the partials' (the generic order loads them after: two round trips in a row). Rows past the first
// AMK_NWARPS * AMK_RS take the generic short-row loop. Per row the same arithmetic as amk_dot_vec's.
template <class T>
__device__ __noinline__ void amk_gemv_group_body(const AmkCtx& c, const float* part, int ns, int G, int D, float* xs,
                                                 float* ps, bool split, int rn, int K, const char* W, float* y) {
  const int warp = amk_warp(), lane = amk_lane(), nc = K / T::VE, rb = warp * AMK_RS;
  const size_t rs = (size_t)K * T::BYTES;
  const AmkSrcGlobal src{amk_policy_evict_first()};
  uint4 v[AMK_RS];
#pragma unroll
  for (int j = 0; j < AMK_RS; ++j) {
    const int r = rb + j < rn ? rb + j : rn - 1;
    v[j] = lane < nc ? src.ld(W + r * rs + (size_t)lane * 16) : make_uint4(0u, 0u, 0u, 0u);
  }
  amk_stage_merged_x(c, part, K, ns, G, D, xs, ps, split);  // ends with a barrier
  if (AMK_DBG_SETUP_MARK) amk_mark(c, 2);  // (the rows were issued before the stage: no setup after it)
  const float* xsm = amk_in_smem(xs);
  if (rb < rn) {
    float acc[AMK_RS];
    amk_fma_rows<T, AMK_RS>(v, xsm, nc, lane, acc);
#pragma unroll
    for (int j = 0; j < AMK_RS; ++j) acc[j] = amk_warp_sum(acc[j]);
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < AMK_RS; ++j)
        if (rb + j < rn) atomicAdd(y + j + rb, acc[j]);
    }
  }
  const int done = AMK_NWARPS * AMK_RS;
  if (rn > done) {
    const char* Wr[1] = {W + done * rs};
    amk_gemv_tile<T, 1>(c, Wr, K, rn - done, xsm, src,
                        [&](int r, const float (&a)[1]) { atomicAdd(y + done + r, a[0]); });
  }
  if (!AMK_DBG_SETUP_MARK) amk_mark(c, 2);
}

__device__ __noinline__ void amk_op_gemv(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int r0 = in.ip[AMK_GEMV_IP_ROW_START], rn = in.ip[AMK_GEMV_IP_ROW_COUNT], K = in.ip[AMK_GEMV_IP_K];
  const bool has_norm = in.ip[AMK_GEMV_IP_HAS_NORM] != 0, has_bias = in.ip[AMK_GEMV_IP_HAS_BIAS] != 0,
             has_res = in.ip[AMK_GEMV_IP_HAS_RESIDUAL] != 0, has_copy = in.ip[AMK_GEMV_IP_HAS_COPY] != 0,
             has_argmax = in.ip[AMK_GEMV_IP_HAS_ARGMAX] != 0;
  int s = AMK_GEMV_N_REQUIRED_IN;
  if (has_norm) ++s;  // the norm weight's slot: staged into c.nw before the wait (amk_prep_norm)
  const int s_bias = has_bias ? s++ : -1, s_res = has_res ? s++ : -1, s_y = s;
  // smem: xs [pad4(K)] | stash (streamed tasks) | residual rows [pad4(rn)] (has_residual) | partials (x_splits)
  float* xs = c.smem;
  AmkGeom g;
  float* tail = xs + amk_pad4(K) + (amk_stream_geom(in, g) ? amk_pad4(amk_stash_floats(g)) : 0);
  float* res_s = has_res ? tail : nullptr;
#if AMK_FLAGS
  const bool res_flag = has_res && amk_slot_flagged(c, s_res), x_flag = amk_slot_flagged(c, AMK_GEMV_IN_X);
  if (has_res) {  // issued together with the x loads below: one round trip instead of one more at the end
    if (res_flag) {  // (a failed poll sets *c.flag: checked after the staging's barrier)
      const uint64_t* res = (const uint64_t*)amk_ptr(c, s_res) + r0;
      for (int i = amk_tid(); i < rn; i += AMK_THREADS)
        if (!amk_ld_flagged1(c, res + i, res_s[i])) break;
    } else {
      const float* res = (const float*)amk_ptr(c, s_res);
      for (int i = amk_tid(); i < rn; i += AMK_THREADS) res_s[i] = __ldcg(res + r0 + i);
    }
    tail += amk_pad4(rn);
  }
  const float* x = (const float*)amk_elem_ptr(c, AMK_GEMV_IN_X, in.ip[AMK_GEMV_IP_X_START]);
#else
  constexpr bool res_flag = false, x_flag = false;
  if (has_res) {  // issued together with the x loads below: one round trip instead of one more at the end
    const float* res = (const float*)amk_ptr(c, s_res);
    for (int i = amk_tid(); i < rn; i += AMK_THREADS) res_s[i] = __ldcg(res + r0 + i);
    tail += amk_pad4(rn);
  }
  const float* x = (const float*)amk_ptr(c, AMK_GEMV_IN_X) + in.ip[AMK_GEMV_IP_X_START];
#endif
  const bool split = amk_x_split(c, AMK_GEMV_IN_W, K);
  const char* wbase = (const char*)amk_ptr(c, AMK_GEMV_IN_W);
  if (AMK_GROUP_EARLY && in.ip[AMK_GEMV_IP_X_SPLITS] > 0 && in.ip[AMK_GEMV_IP_ACCUMULATE] != 0 && !has_bias &&
      !has_res && !has_copy && !has_argmax && (in.flags & (AMK_INSTR_FLAG_STREAM | AMK_INSTR_FLAG_PRELOAD)) == 0 && rn >= 2 * AMK_NWARPS &&
      amk_aligned16(wbase) && amk_aligned16(x)) {
    bool done = false;  // (x_splits rules out has_norm)
    amk_dispatch_dtype(c, amk_dtype(c, AMK_GEMV_IN_W), [&](auto tag) {
      using T = decltype(tag);
      if (K % T::VE != 0 || K / T::VE > 32) return;
      amk_gemv_group_body<T>(c, x, in.ip[AMK_GEMV_IP_X_SPLITS], in.ip[AMK_GEMV_IP_X_GROUP],
                             in.ip[AMK_GEMV_IP_X_HEAD_DIM], xs, tail, split, rn, K,
                             wbase + (size_t)r0 * K * T::BYTES, (float*)amk_ptr(c, s_y) + r0);
      done = true;
    });
    if (done) return;
  }
  float xr = 1.0f;  // y = (W . xs) * xr; both stagings end with a barrier
  if (in.ip[AMK_GEMV_IP_X_SPLITS] > 0)  // (the validator rules out has_norm here)
    amk_stage_merged_x(c, x, K, in.ip[AMK_GEMV_IP_X_SPLITS], in.ip[AMK_GEMV_IP_X_GROUP],
                       in.ip[AMK_GEMV_IP_X_HEAD_DIM], xs, tail, split);
  else
    xr = amk_stage_x(c, x, K, xs, has_norm ? c.nw : nullptr, in.fp[AMK_GEMV_FP_EPS], split, x_flag);
  if ((x_flag || res_flag) && *c.flag) return;  // a flagged input's poll stopped (the task loop exits)
  const void* bias = has_bias ? amk_ptr(c, s_bias) : nullptr;
  const int bias_dt = has_bias ? amk_dtype(c, s_bias) : 0;
  const AmkOut y = amk_out(c, s_y);
  float* ycopy = has_copy ? (float*)amk_ptr(c, s_y + 1) : nullptr;
  float2* pair = has_argmax ? (float2*)amk_ptr(c, s_y + 1 + (has_copy ? 1 : 0)) + in.ip[AMK_GEMV_IP_ARGMAX_SLOT]
                            : nullptr;
  amk_dispatch_dtype(c, amk_dtype(c, AMK_GEMV_IN_W), [&](auto tag) {
    amk_gemv_body<decltype(tag)>(c, xs, r0, rn, K, wbase, bias, bias_dt, res_s, y, ycopy, pair, xr,
                                 in.ip[AMK_GEMV_IP_ACCUMULATE] != 0);
  });
}
