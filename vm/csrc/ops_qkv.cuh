// QKV_ROPE: one projection tile of hn heads (rows [h0*hd, (h0+hn)*hd) of W), fused with the input RMSNorm, bias,
// per-head QK-norm (Qwen3), RoPE (rotate-half, pairs (i, i+hd/2), angle = float(pos) * inv_freq[i]) and the write:
//   mode Q: q[(h0+h)*hd + d] (fp32 activation)
//   mode K/V: cache[h0+h, pos, d] in the cache dtype (round to nearest even); V gets no norm and no RoPE.
//   mode RAW: dst[(h0+h)*hd + d] (fp32 activation), no QK-norm and no RoPE: QK_NORM_ROPE (below) finishes the rows.
// pair_count > 0 (no QK-norm, one head): only the RoPE pairs [ps, ps+pc) of head h0, i.e. rows ps.. and hd/2+ps..;
// both halves stream together as the two matrices of one tile, so a head can be spread over several SMs.
// pos is checked against [0, max_seq): BAD_INPUT otherwise (no write).
// smem: xs[pad4(K)] | ys[pad4(hn*hd)] | stash (streamed tasks, see ops_gemv.cuh)
//
// QK_NORM_ROPE: QK-norm + RoPE of one KV group (its G q heads and its K head) from RAW rows, one warp per head:
// the same epilogue (amk_head_norm_rope) as a whole-head QKV_ROPE task with QK-norm, so both give the same bits.
// smem: ys[pad4((G+1)*hd)] | the two norm weights [2*hd] | inv_freq [pad4(hd/2)], all as fp32
#pragma once
#include "common.cuh"
#include "ops_gemv.cuh"
#include "rope.cuh"

// AMK_DBG_QKV_NOSTREAM 1 (diagnostic builds only, wrong results): the RoPE-pair QKV tiles skip their weight stream
// and dot products (the rest of the task runs), a bound on what the QKV phase's bytes cost (docs/PERF.md,
// forty-eighth session).
#ifndef AMK_DBG_QKV_NOSTREAM
#define AMK_DBG_QKV_NOSTREAM 0
#endif

// ys[r] = (W[row0 + r, :] . xs) * xr + bias[row0 + r]   (r < rows; xr: the RMSNorm scale from amk_stage_x),
// per-dtype body with its own register allocation
template <class T>
__device__ __noinline__ void amk_qkv_gemv_body(const AmkCtx& c, const float* xs, int row0, int rows, int K,
                                               const char* wbase, const void* bias, int bias_dt, float* ys,
                                               float xr) {
  const char* W[1] = {wbase + (size_t)row0 * K * T::BYTES};
  amk_gemv_rows<T, 1>(c, W, K, rows, xs, ys + amk_pad4(rows), [&](int r, const float (&a)[1]) {
    float v = a[0] * xr;
    if (bias) v += amk_ldw(bias, bias_dt, row0 + r);
    ys[r] = v;
  });
}

// Pair slice: ys[r] = row (row0 + r) and ys[pc + r] = row (row0 + half + r), r < pc.
template <class T>
__device__ __noinline__ void amk_qkv_pairs_body(const AmkCtx& c, const float* xs, int row0, int half, int pc, int K,
                                                const char* wbase, const void* bias, int bias_dt, float* ys,
                                                float xr) {
  const char* W[2] = {wbase + (size_t)row0 * K * T::BYTES, wbase + (size_t)(row0 + half) * K * T::BYTES};
  amk_gemv_rows<T, 2>(c, W, K, pc, xs, ys + amk_pad4(2 * pc), [&](int r, const float (&a)[2]) {
    float v0 = a[0] * xr, v1 = a[1] * xr;
    if (bias) {
      v0 += amk_ldw(bias, bias_dt, row0 + r);
      v1 += amk_ldw(bias, bias_dt, row0 + half + r);
    }
    ys[r] = v0;
    ys[pc + r] = v1;
  });
}

__device__ __noinline__ void amk_op_qkv_rope(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int mode = in.ip[AMK_QKV_ROPE_IP_MODE], h0 = in.ip[AMK_QKV_ROPE_IP_HEAD_START];
  const int hn = in.ip[AMK_QKV_ROPE_IP_HEAD_COUNT], hd = in.ip[AMK_QKV_ROPE_IP_HEAD_DIM];
  const int K = in.ip[AMK_QKV_ROPE_IP_K], S = in.ip[AMK_QKV_ROPE_IP_MAX_SEQ];
  const bool has_norm = in.ip[AMK_QKV_ROPE_IP_HAS_NORM] != 0, has_bias = in.ip[AMK_QKV_ROPE_IP_HAS_BIAS] != 0;
  const bool has_qkn = in.ip[AMK_QKV_ROPE_IP_HAS_QKNORM] != 0;
  int s = AMK_QKV_ROPE_N_REQUIRED_IN;
  if (has_norm) ++s;  // the norm weight's slot: staged into c.nw before the wait (amk_prep_norm)
  const int s_bias = has_bias ? s++ : -1, s_qkn = has_qkn ? s++ : -1, s_dst = s;

  const int pos = amk_io_scalar(c, AMK_QKV_ROPE_IN_POS);
  if (pos < 0 || pos >= S) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, pos);
    return;
  }
  float* xs = c.smem;
  float* ys = xs + amk_pad4(K);
  const bool x_flag = amk_slot_flagged(c, AMK_QKV_ROPE_IN_X);
  const float xr = amk_stage_x(c, (const float*)amk_ptr(c, AMK_QKV_ROPE_IN_X), K, xs, has_norm ? c.nw : nullptr,
                               in.fp[AMK_QKV_ROPE_FP_EPS], amk_x_split(c, AMK_QKV_ROPE_IN_W, K),
                               x_flag);  // ys = (W . xs) * xr
  if (x_flag && *c.flag) return;  // the flagged input's poll stopped (the task loop exits)
  const void* bias = has_bias ? amk_ptr(c, s_bias) : nullptr;
  const int bias_dt = has_bias ? amk_dtype(c, s_bias) : 0;
  const int row0 = h0 * hd;
  const char* wbase = (const char*)amk_ptr(c, AMK_QKV_ROPE_IN_W);
  const int ps = in.ip[AMK_QKV_ROPE_IP_PAIR_START], pc = in.ip[AMK_QKV_ROPE_IP_PAIR_COUNT];
  const int half = hd >> 1, lane = amk_lane();
  const bool flat = mode == AMK_QKV_MODE_Q || mode == AMK_QKV_MODE_RAW;  // fp32 [heads, hd] destination
  if (pc > 0) {  // RoPE pairs [ps, ps+pc) of head h0 (the validator guarantees hn == 1 and no QK-norm)
    if (!AMK_DBG_QKV_NOSTREAM)
      amk_dispatch_dtype(c, amk_dtype(c, AMK_QKV_ROPE_IN_W), [&](auto tag) {
        amk_qkv_pairs_body<decltype(tag)>(c, xs, row0 + ps, half, pc, K, wbase, bias, bias_dt, ys, xr);
      });
    amk_sync();
    if (*c.flag) return;
    const float* inv_freq = (const float*)amk_ptr(c, AMK_QKV_ROPE_IN_INV_FREQ);
    const int inv_dt = amk_dtype(c, AMK_QKV_ROPE_IN_INV_FREQ);
    void* dst = amk_ptr(c, s_dst);
    const int dst_dt = amk_dtype(c, s_dst);
    const int64_t base = flat ? (int64_t)h0 * hd : ((int64_t)h0 * S + pos) * hd;
    for (int i = amk_tid(); i < pc; i += AMK_THREADS) {
      float o1 = ys[i], o2 = ys[pc + i];
      if (mode == AMK_QKV_MODE_Q || mode == AMK_QKV_MODE_K)
        amk_rope_pair(o1, o2, pos, amk_ldw(inv_freq, inv_dt, ps + i), o1, o2);
      if (flat) {
        ((float*)dst)[base + ps + i] = o1;
        ((float*)dst)[base + half + ps + i] = o2;
      } else {
        amk_store_elem(dst, dst_dt, base + ps + i, o1);
        amk_store_elem(dst, dst_dt, base + half + ps + i, o2);
      }
    }
    return;
  }
  amk_dispatch_dtype(c, amk_dtype(c, AMK_QKV_ROPE_IN_W), [&](auto tag) {
    amk_qkv_gemv_body<decltype(tag)>(c, xs, row0, hn * hd, K, wbase, bias, bias_dt, ys, xr);
  });
  amk_sync();
  if (*c.flag) return;  // the weight ring reported an error (uniform after the barrier)

  const void* qkn = has_qkn ? amk_ptr(c, s_qkn) : nullptr;
  const int qkn_dt = has_qkn ? amk_dtype(c, s_qkn) : 0;
  const float* inv_freq = (const float*)amk_ptr(c, AMK_QKV_ROPE_IN_INV_FREQ);  // CONST fp32 [hd/2]
  const int inv_dt = amk_dtype(c, AMK_QKV_ROPE_IN_INV_FREQ);
  void* dst = amk_ptr(c, s_dst);
  const int dst_dt = amk_dtype(c, s_dst);
  const float qk_eps = in.fp[AMK_QKV_ROPE_FP_QK_EPS];
  for (int h = amk_warp(); h < hn; h += AMK_NWARPS) {  // one warp per head
    float* y = ys + h * hd;
    // element index of (head h0+h, dim 0) in the destination
    const int64_t base = flat ? (int64_t)(h0 + h) * hd : ((int64_t)(h0 + h) * S + pos) * hd;
    if (mode == AMK_QKV_MODE_V || mode == AMK_QKV_MODE_RAW) {
      for (int d = lane; d < hd; d += 32) amk_store_elem(dst, dst_dt, base + d, y[d]);
      continue;
    }
    amk_head_norm_rope(
        y, hd, qkn != nullptr, [&](int d) { return amk_ldw(qkn, qkn_dt, d); }, qk_eps, pos,
        [&](int i) { return amk_ldw(inv_freq, inv_dt, i); }, [&](int d, float v) {
      if (mode == AMK_QKV_MODE_Q) ((float*)dst)[base + d] = v;
      else amk_store_elem(dst, dst_dt, base + d, v);
    });
  }
}

__device__ __noinline__ void amk_op_qk_norm_rope(const AmkCtx& c) {
  const AmkInstr& in = *c.ins;
  const int g = in.ip[AMK_QK_NORM_ROPE_IP_KV_HEAD], G = in.ip[AMK_QK_NORM_ROPE_IP_GROUP];
  const int hd = in.ip[AMK_QK_NORM_ROPE_IP_HEAD_DIM], S = in.ip[AMK_QK_NORM_ROPE_IP_MAX_SEQ];
  const int pos = amk_io_scalar(c, AMK_QK_NORM_ROPE_IN_POS);
  if (pos < 0 || pos >= S) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, pos);
    return;
  }
  const float* q_raw = (const float*)amk_ptr(c, AMK_QK_NORM_ROPE_IN_Q_RAW) + (int64_t)g * G * hd;
  const float* k_raw = (const float*)amk_ptr(c, AMK_QK_NORM_ROPE_IN_K_RAW) + (int64_t)g * hd;
  const void* qw = amk_ptr(c, AMK_QK_NORM_ROPE_IN_Q_NORM_W);
  const void* kw = amk_ptr(c, AMK_QK_NORM_ROPE_IN_K_NORM_W);
  const void* inv = amk_ptr(c, AMK_QK_NORM_ROPE_IN_INV_FREQ);
  const int qw_dt = amk_dtype(c, AMK_QK_NORM_ROPE_IN_Q_NORM_W), kw_dt = amk_dtype(c, AMK_QK_NORM_ROPE_IN_K_NORM_W);
  const int inv_dt = amk_dtype(c, AMK_QK_NORM_ROPE_IN_INV_FREQ);
  // smem: ys [G q heads | K head] x hd | wn [q_norm_w | k_norm_w] (fp32) | fr [inv_freq] (fp32); every load is
  // issued in one pass: one round trip, not one for the rows, then the weight, then inv_freq
  const int nr = (G + 1) * hd, half = hd >> 1;
  float* ys = amk_in_smem(c.smem);
  float* wn = ys + amk_pad4(nr);
  float* fr = wn + 2 * hd;
  for (int i = amk_tid(); i < nr + 2 * hd + half; i += AMK_THREADS) {
    if (i < G * hd) ys[i] = __ldcg(q_raw + i);
    else if (i < nr) ys[i] = __ldcg(k_raw + (i - G * hd));
    else if (i < nr + hd) wn[i - nr] = amk_ldw(qw, qw_dt, i - nr);
    else if (i < nr + 2 * hd) wn[i - nr] = amk_ldw(kw, kw_dt, i - nr - hd);
    else fr[i - nr - 2 * hd] = amk_ldw(inv, inv_dt, i - nr - 2 * hd);
  }
  amk_sync();
  float* q = (float*)amk_ptr(c, AMK_QK_NORM_ROPE_N_REQUIRED_IN) + (int64_t)g * G * hd;
  void* kc = amk_ptr(c, AMK_QK_NORM_ROPE_N_REQUIRED_IN + 1);
  const int kc_dt = amk_dtype(c, AMK_QK_NORM_ROPE_N_REQUIRED_IN + 1);
  const int64_t kbase = ((int64_t)g * S + pos) * hd;
  amk_group_norm_rope(ys, ys + G * hd, wn, wn + hd, fr, G, hd, in.fp[AMK_QK_NORM_ROPE_FP_EPS], pos, q, kc, kc_dt,
                      kbase);
}
