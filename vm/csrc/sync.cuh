// Inter-block synchronisation of the megakernel: acquire waits with backoff + timeout, release increments,
// and L2 weight prefetch issued before a block spins (weights never wait on activations).
//
// Protocol (schedule/ir.py): counters start at 0 each launch. Producer: __syncthreads(); thread 0 does a
// gpu-scope release add (cumulative over the block's writes ordered by the barrier). Consumer: thread 0 spins
// with gpu-scope acquire loads until counter >= threshold, then __syncthreads(); data is then read with __ldcg.
#pragma once
#include "common.cuh"

__device__ __forceinline__ int amk_ld_acquire(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int amk_ld_relaxed(const int32_t* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void amk_signal(int32_t* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(1) : "memory");
}
__device__ __forceinline__ uint64_t amk_globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0, when a task is about to spin on an unsatisfied wait: ask L2 for the first `cap` bytes of the task's
// weight ranges (p.wait_prefetch_bytes, knob wait_prefetch_kb), so the HBM works for this SM while it waits
// (weights never wait on activations). Tasks whose waits are already satisfied issue nothing: no extra traffic
// competes with SMs that are streaming.
__device__ __forceinline__ void amk_wait_prefetch(const AmkInstr& in, int64_t cap) {
  if (cap <= 0) return;
  const int nr = in.prefetch_bytes[1] > 0 ? 2 : 1;
  for (int k = 0; k < nr && k < AMK_MAX_PREFETCH; ++k) {
    const uint64_t ptr = in.prefetch_ptr[k];
    int64_t bytes = (int64_t)in.prefetch_bytes[k];
    if (ptr == 0 || bytes <= 0) continue;
    if (bytes > cap / nr) bytes = cap / nr;
    const uint64_t base = (ptr + 15) & ~15ull;  // 16-byte aligned, inside the range
    bytes = (int64_t)(((ptr + (uint64_t)bytes) & ~15ull) - base);
    constexpr int64_t CH = 16384;
    for (int64_t off = 0; off < bytes; off += CH) {
      const unsigned sz = (unsigned)((bytes - off) < CH ? (bytes - off) : CH);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + off), "r"(sz) : "memory");
#else
      for (unsigned b = 0; b < sz; b += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(base + off + b));
#endif
    }
  }
}

// Thread 0 only. Returns 1 if the block must stop (abort flag seen, or this wait timed out and was reported).
// The abort flag and the counter are loaded back to back, on entry and in every poll (one round trip, not two;
// AMK_WAIT_OVERLAP 0: the flag's load waits for the counter's, and on entry comes first). Every task pays the
// entry check on its way in, satisfied or not, and a waiting task sees its counter one poll sooner.
#ifndef AMK_WAIT_OVERLAP
#define AMK_WAIT_OVERLAP 1
#endif
// Poll backoff: __nanosleep from AMK_POLL_NS_MIN doubling up to AMK_POLL_NS_MAX ns between polls (0: no sleep).
#ifndef AMK_POLL_NS_MIN
#define AMK_POLL_NS_MIN 16
#endif
#ifndef AMK_POLL_NS_MAX
#define AMK_POLL_NS_MAX 128
#endif
__device__ __noinline__ int amk_wait_all(const AmkParams& p, const AmkInstr& in, int sm) {
  int aborted = amk_ld_relaxed(p.status + AMK_STATUS_ABORT);
  if (!AMK_WAIT_OVERLAP && aborted) return 1;
  const int nw = in.n_waits < AMK_MAX_WAITS ? in.n_waits : AMK_MAX_WAITS;
  bool prefetched = false;
  for (int w = 0; w < nw; ++w) {
    const int c = in.wait_counter[w], thr = in.wait_threshold[w];
    const int32_t* ctr = p.counters + c;
    const int v = amk_ld_acquire(ctr);
    if (aborted) return 1;
    if (v >= thr) continue;
    if (!prefetched && !(in.flags & AMK_INSTR_FLAG_PRELOAD)) {  // a preloaded tile is already on its way
      amk_wait_prefetch(in, p.wait_prefetch_bytes);
      prefetched = true;
    }
    const uint64_t t0 = amk_globaltimer();
    unsigned ns = AMK_POLL_NS_MIN;
    for (;;) {
      if (AMK_POLL_NS_MAX > 0) {
        __nanosleep(ns);
        if (ns < AMK_POLL_NS_MAX) ns <<= 1;
      }
      if (AMK_WAIT_OVERLAP) {  // one round trip per poll: the flag's load is in flight with the counter's
        const int ab = amk_ld_relaxed(p.status + AMK_STATUS_ABORT);
        if (amk_ld_acquire(ctr) >= thr) break;
        if (ab) return 1;
      } else {
        if (amk_ld_acquire(ctr) >= thr) break;
        if (amk_ld_relaxed(p.status + AMK_STATUS_ABORT)) return 1;
      }
      if ((int64_t)(amk_globaltimer() - t0) > p.timeout_ns) {
        amk_report(p, AMK_ERR_TIMEOUT, in.task_id, in.op, c, sm);
        return 1;
      }
    }
  }
  return aborted;  // (a task without waits: only the flag)
}

// Block-wide: ask L2 for bytes [ptr, ptr + bytes), trimmed inward to 16-byte alignment; one bulk prefetch per CH
// bytes on sm_90+, one prefetch per 128-byte line before.
__device__ __forceinline__ void amk_prefetch_range(uint64_t ptr, int64_t bytes) {
  if (ptr == 0 || bytes <= 0) return;
  const uint64_t base = (ptr + 15) & ~15ull;  // 16-byte aligned, inside the range
  bytes = (int64_t)(((ptr + (uint64_t)bytes) & ~15ull) - base);
  if (bytes <= 0) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t CH = 4096;
  const int64_t n = (bytes + CH - 1) / CH;
  for (int64_t i = amk_tid(); i < n; i += AMK_THREADS) {
    const int64_t off = i * CH;
    const unsigned sz = (unsigned)((bytes - off) < CH ? (bytes - off) : CH);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + off), "r"(sz) : "memory");
  }
#else
  const int64_t n = (bytes + 127) / 128;
  for (int64_t i = amk_tid(); i < n; i += AMK_THREADS)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(base + i * 128));
#endif
}

// Block-wide: ask L2 to fetch the first `cap` bytes of each of an instruction's weight ranges (global memory).
__device__ __forceinline__ void amk_prefetch_instr(const AmkInstr* in, int64_t cap) {
  if (cap <= 0) return;
  const int nr = __ldg((const long long*)&in->prefetch_bytes[1]) > 0 ? 2 : 1;
#pragma unroll
  for (int k = 0; k < AMK_MAX_PREFETCH; ++k) {
    if (k >= nr) break;
    const uint64_t ptr = __ldg((const unsigned long long*)&in->prefetch_ptr[k]);
    const int64_t bytes = (int64_t)__ldg((const long long*)&in->prefetch_bytes[k]);
    amk_prefetch_range(ptr, bytes < cap / nr ? bytes : cap / nr);
  }
}
