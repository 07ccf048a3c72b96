// RoPE and the per-head QK-norm epilogue, shared by QKV_ROPE / QK_NORM_ROPE (ops_qkv.cuh) and the attention ops'
// folded QK-norm (ops_attention.cuh, qk_norm): one definition, so every path that finishes a q or K row gives the
// same bits.
#pragma once
#include "common.cuh"

// One RoPE pair (a, b) at angle pos * freq, rotate-half convention; the exact op order both QKV paths use.
__device__ __forceinline__ void amk_rope_pair(float a, float b, int pos, float freq, float& o1, float& o2) {
  const float ang = __fmul_rn((float)pos, freq);
  float sn, cs;
  sincosf(ang, &sn, &cs);
  o1 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
  o2 = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
}

// One head's epilogue, by one warp: y (hd floats in shared memory) <- rmsnorm(y) * w(d) when norm (QK-norm), then
// the RoPE pairs (i, i + hd/2) at angle pos * freq(i) go to out(i, o1) and out(i + hd/2, o2).
template <class W, class F, class Out>
__device__ __forceinline__ void amk_head_norm_rope(float* y, int hd, bool norm, W w, float eps, int pos, F freq,
                                                   Out out) {
  const int lane = amk_lane(), half = hd >> 1;
  if (norm) {
    float ss = 0.f;
    for (int d = lane; d < hd; d += 32) ss += y[d] * y[d];
    ss = amk_warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int d = lane; d < hd; d += 32) y[d] = (y[d] * r) * w(d);
    __syncwarp();
  }
  for (int i = lane; i < half; i += 32) {
    float o1, o2;
    amk_rope_pair(y[i], y[i + half], pos, freq(i), o1, o2);
    out(i, o1);
    out(i + half, o2);
  }
}

// One KV group's QK-norm + RoPE, one warp per head (QK_NORM_ROPE, and the attention ops' folded QK-norm): the G
// RAW q rows qr [G, hd] (shared memory, normalised in place) -> q [G, hd] (fp32), and with kr (the group's RAW K
// row, may be null) that row -> the cache row at kc + kbase elements (cache dtype kc_dt). qw / kw: the norm
// weights, fr: inv_freq, all fp32 in shared memory.
__device__ __forceinline__ void amk_group_norm_rope(float* qr, float* kr, const float* qw, const float* kw,
                                                    const float* fr, int G, int hd, float eps, int pos, float* q,
                                                    void* kc, int kc_dt, int64_t kbase) {
  for (int h = amk_warp(); h < G + (kr ? 1 : 0); h += AMK_NWARPS) {  // h == G: the K row
    const bool isk = h == G;
    const float* w = isk ? kw : qw;
    amk_head_norm_rope(isk ? kr : qr + h * hd, hd, true, [&](int d) { return w[d]; }, eps, pos,
                       [&](int i) { return fr[i]; }, [&](int d, float v) {
                         if (!isk) q[h * hd + d] = v;
                         else amk_store_elem(kc, kc_dt, kbase + d, v);
                       });
  }
}
