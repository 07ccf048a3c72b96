// MLP tiles: GEMV_SILU_MUL (gate/up + SiLU*up) and GEMV_SILU_MUL_DOWN (the same tile with its down_proj share added
// into the residual stream), built on the GEMV streaming loops of ops_gemv.cuh.
//   GEMV_SILU_MUL:      h[r] = silu(Wg[r,:] . f(x)) * (Wu[r,:] . f(x))                  for r in [r0, r0+rn)
//   GEMV_SILU_MUL_DOWN: y[0:N] += Wd[:, r0:r0+rn] . h[r0:r0+rn]  (fp32 atomic adds; no h buffer, no down hop)
//   f(x) = rmsnorm(x) * norm_w if has_norm else x (staged once per task; the 1/rms scale multiplies the sums).
// Claim groups (dyn_rows > 0): members take their own rows, then draw further chunks from a shared ticket counter.
#pragma once
#include "common.cuh"
#include "ops_gemv.cuh"

__device__ __forceinline__ float amk_silu(float g) { return g / (1.0f + expf(-g)); }
// h = silu(gate . x) * (up . x) from a gate/up row pair's sums a and the RMSNorm scale xr.
__device__ __forceinline__ float amk_silu_mul(const float (&a)[2], float xr) { return amk_silu(a[0] * xr) * (a[1] * xr); }

// A claim group's next chunk, broadcast to the block: two slots used in turn, so thread 0's next write cannot
// overtake a thread still reading the last one (a barrier separates every two writes of one slot).
__shared__ int amk_s_chunk[2];
// Per-warp claims (dyn_rows 1): set once a warp of this block drew a ticket past the end, so its other warps stop
// drawing (a hint: a warp that still draws only gets a ticket past the end too). Cleared before x is staged.
__shared__ volatile int amk_s_drained;

// A claim-group member with one-row tickets and an own tile of at least one row per warp: each warp streams its own
// rows as the static tile loop does (rows a0 + warp, +NWARPS, ...) and, from its last own row on, draws one ticket
// per row itself (lane 0's atomic is issued before the row it is working on and read after it), so no warp waits
// for a block barrier between its own rows and the drawn ones and the SM keeps its loads in flight to the end.
// Per row the arithmetic of the static tile loop (one warp per row, amk_dot + warp sums).
template <class T>
__device__ __forceinline__ void amk_silu_warp_claims(const AmkCtx& c, const float* xs, int r0, int K, const char* g0,
                                                     const char* u0, AmkOut h, float xr, int a0, int n0,
                                                     int own_end, int n_tk, int* ctr) {
  const int warp = amk_warp(), lane = amk_lane();
  const size_t rs = (size_t)K * T::BYTES;
  const float* xsm = amk_in_smem(xs);
  const AmkSrcGlobal src{amk_policy_evict_first()};
  if (AMK_DBG_SETUP_MARK) amk_mark(c, 2);
  int r = warp < n0 ? a0 + warp : -1;   // this warp's current row (relative to r0), -1: none yet
  while (true) {
    int nxt = (r >= 0 && r < a0 + n0 && r + AMK_NWARPS < a0 + n0) ? r + AMK_NWARPS : -1;
    const bool draw = nxt < 0 && !amk_s_drained;
    int tk = 0;
    if (draw && lane == 0) tk = atomicAdd(ctr, 1);  // read after the row below: its round trip overlaps the row
    if (r >= 0) {
      const char* rows[2] = {g0 + (size_t)(r0 + r) * rs, u0 + (size_t)(r0 + r) * rs};
      const bool vec = (K % T::VE) == 0 && amk_aligned16(rows[0]) && amk_aligned16(rows[1]);
      float acc[2] = {0.f, 0.f};
      amk_dot<T, 2, AMK_U2>(rows, xsm, K, vec, lane, 32, src, acc);
      acc[0] = amk_warp_sum(acc[0]);
      acc[1] = amk_warp_sum(acc[1]);
      if (lane == 0) AMK_PUT(h, r0 + r, amk_silu_mul(acc, xr));
    }
    if (draw) {
      tk = __shfl_sync(0xffffffffu, tk, 0);
      if (tk < n_tk) nxt = own_end + tk;
      else if (lane == 0) amk_s_drained = 1;
    }
    if (nxt < 0) break;
    r = nxt;
  }
  if (!AMK_DBG_SETUP_MARK) amk_mark(c, 2);
}

// Rows [r0, r0+rn) of the gate/up matrices, or for a claim-group member (dyn_rows > 0, vm/abi.py) the rows it
// gets: its own [j*S, (j+1)*S), then the chunk [N*S + t*dr, +dr) of each ticket t drawn from the claim counter
// until the chunks run out. Thread 0 draws the next ticket when a range starts and reads it when the range is done,
// so the atomic's round trip overlaps the weight stream. A range is a static tile of its size: the same arithmetic
// per row, whichever member computes it.
template <class T>
__device__ __noinline__ void amk_silu_body(const AmkCtx& c, const float* xs, int r0, int rn, int K, const char* g0,
                                           const char* u0, AmkOut h, float xr) {
  auto tile = [&](int a, int n) {
    const size_t off = (size_t)a * K * T::BYTES;
    const char* W[2] = {g0 + off, u0 + off};
    amk_gemv_rows<T, 2>(c, W, K, n, xs, c.smem + amk_pad4(K),
                        [&](int r, const float (&v)[2]) { AMK_PUT(h, a + r, amk_silu_mul(v, xr)); });
  };
  const AmkInstr& in = *c.ins;
  const int dr = in.ip[AMK_GEMV_SILU_MUL_IP_DYN_ROWS];
  if (dr <= 0) {
    tile(r0, rn);
    return;
  }
  const int N = in.ip[AMK_GEMV_SILU_MUL_IP_DYN_TASKS], claim = in.ip[AMK_GEMV_SILU_MUL_IP_DYN_CLAIM];
  const int S = in.ip[AMK_GEMV_SILU_MUL_IP_DYN_STATIC] > 0 ? in.ip[AMK_GEMV_SILU_MUL_IP_DYN_STATIC] : dr;
  if (claim < 0 || claim >= c.p->n_counters || N < 1) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, claim);
    return;
  }
  int* ctr = c.p->counters + claim;
  const long long own_end = (long long)N * S;
  const int n_tk = own_end < rn ? (int)((rn - own_end + dr - 1) / dr) : 0;   // chunks handed out by ticket
  const long long j0 = (long long)in.ip[AMK_GEMV_SILU_MUL_IP_DYN_INDEX] * S;
  int a = j0 < rn ? (int)j0 : rn;
  int n = rn - a < S ? rn - a : S;
  if (dr == 1 && S >= AMK_NWARPS) {   // one-row tickets drawn by each warp: no block barrier between ranges
    amk_silu_warp_claims<T>(c, xs, r0, K, g0, u0, h, xr, a, n, (int)own_end, n_tk, ctr);
    return;
  }
  for (int it = 0;; ++it) {
    int tk = 0;
    if (amk_tid() == 0 && n_tk > 0) tk = atomicAdd(ctr, 1);  // the next ticket: in flight while this range streams
    if (n > 0) tile(r0 + a, n);
    if (n_tk == 0) break;
    if (amk_tid() == 0) amk_s_chunk[it & 1] = tk;
    amk_sync();
    tk = amk_s_chunk[it & 1];
    if (tk >= n_tk) break;
    a = (int)own_end + tk * dr;
    n = rn - a < dr ? rn - a : dr;
  }
}

__device__ __noinline__ void amk_op_gemv_silu_mul(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int r0 = in.ip[AMK_GEMV_SILU_MUL_IP_ROW_START], rn = in.ip[AMK_GEMV_SILU_MUL_IP_ROW_COUNT];
  const int K = in.ip[AMK_GEMV_SILU_MUL_IP_K];
  const bool has_norm = in.ip[AMK_GEMV_SILU_MUL_IP_HAS_NORM] != 0;
  int s = AMK_GEMV_SILU_MUL_N_REQUIRED_IN;
  if (has_norm) ++s;  // the norm weight's slot: staged into c.nw before the wait (amk_prep_norm)
  const int s_h = s;
  float* xs = c.smem;  // [pad4(K)] | stash (streamed tasks)
  if (amk_tid() == 0) amk_s_drained = 0;  // (claim groups; the staging below ends with a barrier)
  const bool x_flag = amk_slot_flagged(c, AMK_GEMV_SILU_MUL_IN_X);
  const float xr = amk_stage_x(c, (const float*)amk_ptr(c, AMK_GEMV_SILU_MUL_IN_X), K, xs,
                               has_norm ? c.nw : nullptr, in.fp[AMK_GEMV_SILU_MUL_FP_EPS],
                               amk_x_split(c, AMK_GEMV_SILU_MUL_IN_W_GATE, K), x_flag);
  if (x_flag && *c.flag) return;  // the flagged input's poll stopped (the task loop exits)
  const AmkOut h = amk_out(c, s_h);
  const char* g0 = (const char*)amk_ptr(c, AMK_GEMV_SILU_MUL_IN_W_GATE);
  const char* u0 = (const char*)amk_ptr(c, AMK_GEMV_SILU_MUL_IN_W_UP);
  // gate and up share the program's dtype; the gate's descriptor decides.
  amk_dispatch_dtype(c, amk_dtype(c, AMK_GEMV_SILU_MUL_IN_W_GATE), [&](auto tag) {
    amk_silu_body<decltype(tag)>(c, xs, r0, rn, K, g0, u0, h, xr);
  });
}

// Build switch of the fused MLP tile's down part: loads per lane in flight (docs/PERF.md, nineteenth session: 16 and
// 4 measured slower or equal on llama-3.2-1b, H100).
#ifndef AMK_DOWN_RS
#define AMK_DOWN_RS AMK_RS
#endif

// GEMV_SILU_MUL_DOWN: the gate/up rows of the tile as GEMV_SILU_MUL computes them, kept in shared memory (hs, in
// the staged-x layout of a length-rn input), then y[0:N] += Wd . hs (Wd: the tile's [N, rn] column block of
// down_proj, contiguous) with atomic fp32 adds. Each warp issues its first down rows before the barrier that
// completes hs, so their round trip overlaps the gate/up tail.
template <class T>
__device__ __noinline__ void amk_silu_down_body(const AmkCtx& c, const float* xs, float* hs, int r0, int rn, int K,
                                                const char* g0, const char* u0, const char* wd, int N, float* y,
                                                float xr) {
  const size_t off = (size_t)r0 * K * T::BYTES;
  const char* W[2] = {g0 + off, u0 + off};
  float* hsm = amk_in_smem(hs);
  const bool hsplit = amk_x_split(T::BYTES, rn);
  amk_gemv_rows<T, 2>(c, W, K, rn, xs, hsm, [&](int r, const float (&a)[2]) {
    hsm[amk_xpos(r, rn, hsplit)] = amk_silu_mul(a, xr);
  });
  const AmkSrcGlobal src{amk_policy_evict_first()};
  auto add = [&](int r, const float (&a)[1]) { atomicAdd(y + r, a[0]); };
  if (rn % T::VE == 0 && rn / T::VE <= 32 && amk_aligned16(wd)) {
    amk_short_rows<T, AMK_DOWN_RS>(wd, (size_t)rn * T::BYTES, hsm, rn / T::VE, N, src, true, [] { amk_sync(); },
                                   add);
  } else {
    amk_sync();
    const char* Wd[1] = {wd};
    amk_gemv_tile<T, 1>(c, Wd, rn, N, hsm, src, add);
  }
  amk_mark(c, 3);
}

__device__ __noinline__ void amk_op_gemv_silu_mul_down(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int r0 = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_ROW_START], rn = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_ROW_COUNT];
  const int K = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_K], N = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_OUT_N];
  const bool has_norm = in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_HAS_NORM] != 0;
  const int s_y = AMK_GEMV_SILU_MUL_DOWN_N_REQUIRED_IN + (has_norm ? 1 : 0);
  float* xs = c.smem;  // [pad4(K)] | hs [pad4(rn)]
  const float xr = amk_stage_x(c, (const float*)amk_ptr(c, AMK_GEMV_SILU_MUL_DOWN_IN_X), K, xs,
                               has_norm ? c.nw : nullptr, in.fp[AMK_GEMV_SILU_MUL_DOWN_FP_EPS],
                               amk_x_split(c, AMK_GEMV_SILU_MUL_DOWN_IN_W_GATE, K));
  const char* g0 = (const char*)amk_ptr(c, AMK_GEMV_SILU_MUL_DOWN_IN_W_GATE);
  const char* u0 = (const char*)amk_ptr(c, AMK_GEMV_SILU_MUL_DOWN_IN_W_UP);
  const char* wd = (const char*)amk_ptr(c, AMK_GEMV_SILU_MUL_DOWN_IN_W_DOWN);
  float* y = (float*)amk_ptr(c, s_y);
  amk_dispatch_dtype(c, amk_dtype(c, AMK_GEMV_SILU_MUL_DOWN_IN_W_GATE), [&](auto tag) {
    amk_silu_down_body<decltype(tag)>(c, xs, xs + amk_pad4(K), r0, rn, K, g0, u0, wd, N, y, xr);
  });
}
