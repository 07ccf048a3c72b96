// Whole-tile weight preload (sm_90+, launch knob preload_kb): a GEMV-family task flagged AMK_INSTR_FLAG_PRELOAD by
// the loader (its whole weight tile fits the preload buffer) gets its weight ranges bulk-copied into shared memory
// BEFORE it waits on its counters -- at the start of the task before it in the block's queue (vm/loader.py
// preload_issuer), so the copy overlaps that task (attention, before o_proj: the HBM is mostly idle then) and the
// phase boundary costs no HBM round trip. The op then runs its usual GEMV tile over shared memory.
//
// One buffer, one mbarrier, at most one preload in flight or resident per block, owned by one producer thread
// (AMK_PRE_THREAD, lane 0 of warp 1, so thread 0's counter waits are not delayed):
//   * launch start: the producer scans its queue once and issues the first flagged task;
//   * a flagged task (all threads) waits on the barrier's phase (bounded, TIMEOUT detail AMK_PRELOAD_DETAIL),
//     computes from the buffer;
//   * a task whose AmkInstr.next_preload is set (by the loader: the task just before the next flagged one, never
//     before the previous flagged one is done with the buffer) has the producer issue that tile at its start,
//     concurrently with thread 0's counter wait. (The sixth to tenth sessions issued it right after the previous
//     flagged task, i.e. during the MLP streaming of the layer before: preload_kb 64 measured +4.6%.)
// Weights are CONST for the whole launch, so reading them before any wait is always safe (the validator's
// happens-before proofs concern activations and caches only). The buffer lives between the weight ring and the op
// area of the dynamic shared memory: [ring | preload buffer (p.preload_bytes) | op area].
// Buffer layout: the task's prefetch ranges back to back (range 0 at offset 0, range 1 at prefetch_bytes[0]).
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"

// Compiled in only for builds that ask for it (vm/jit.py BuildSpec.preload, -DAMK_PRELOAD=1; the loader asks when
// preload_kb > 0): the shared-memory tile instantiations grow every GEMV body. On an H100, llama-3.2-1b steps with
// the path compiled in but unused measured ~1552 us vs ~1507-1516 us compiled out (separate runs; docs/PERF.md).
#ifndef AMK_PRELOAD
#define AMK_PRELOAD 0
#endif
#define AMK_PRE_DEVICE (AMK_MBAR_DEVICE && AMK_PRELOAD)
#define AMK_PRELOAD_DETAIL (-100)  // TIMEOUT detail word: the preload barrier never completed

#define AMK_PRE_THREAD (AMK_THREADS > 32 ? 32 : 0)

struct AmkPre {
  int q;         // instruction index whose tile is in flight / resident (-1: none)
  uint32_t n;    // preloads issued so far (the current one completes phase (n - 1) & 1)
  uint32_t bar;  // shared address of the mbarrier
  uint32_t base; // shared address of the buffer
};

__device__ __forceinline__ bool amk_pre_flagged(const AmkInstr& in) {
  return AMK_PRE_DEVICE && (in.flags & AMK_INSTR_FLAG_PRELOAD) != 0;
}

// Producer: bulk-copy the weight ranges of instruction `idx` into the (free) buffer.
__device__ __forceinline__ void amk_pre_issue(const AmkParams& p, AmkPre& P, int idx) {
#if AMK_PRE_DEVICE
  const AmkInstr* in = p.instrs + idx;
  const int64_t b0 = __ldg((const long long*)&in->prefetch_bytes[0]);
  const int64_t b1 = __ldg((const long long*)&in->prefetch_bytes[1]);
  const uint64_t s0 = __ldg((const unsigned long long*)&in->prefetch_ptr[0]);
  const uint64_t s1 = __ldg((const unsigned long long*)&in->prefetch_ptr[1]);
  const uint64_t pol = amk_policy_evict_first();
  // earlier generic-proxy reads of the buffer are ordered before these async-proxy writes
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  amk_mbar_expect(P.bar, (uint32_t)(b0 + (b1 > 0 ? b1 : 0)));
  amk_bulk_g2s(P.base, s0, (uint32_t)b0, P.bar, pol);
  if (b1 > 0) amk_bulk_g2s(P.base + (uint32_t)b0, s1, (uint32_t)b1, P.bar, pol);
  P.q = idx;
  ++P.n;
#else
  (void)p; (void)P; (void)idx;
#endif
}

// Producer, once per launch (before the first barrier of the queue loop): issue the queue's first flagged task.
__device__ __forceinline__ void amk_pre_init(const AmkParams& p, AmkPre& P, uint64_t* bar, void* base, int q0,
                                             int q1) {
  P.q = -1;
  P.n = 0;
  P.bar = amk_smem_addr(bar);
  P.base = amk_smem_addr(base);
  if (!AMK_PRE_DEVICE || p.preload_bytes <= 0) return;
  amk_mbar_init(P.bar);
  for (int q = q0; q < q1; ++q) {
    const int idx = __ldg(p.queue_items + q);
    if (__ldg(&p.instrs[idx].flags) & AMK_INSTR_FLAG_PRELOAD) {
      amk_pre_issue(p, P, idx);
      return;
    }
  }
}

// All threads of a flagged task whose tile is the resident one (P.q == its instruction index): wait until it has
// landed. false: the block must stop (abort seen or timeout reported; *c.flag is set).
__device__ __forceinline__ bool amk_pre_wait(const AmkCtx& c) {
  const uint32_t parity = (c.pre->n - 1u) & 1u;  // stable: the producer changes n only between tasks
  if (amk_tid() == 0 && amk_mbar_wait(*c.p, c.pre->bar, parity, *c.ins, AMK_PRELOAD_DETAIL, c.sm)) *c.flag = 1;
  amk_sync();
  if (*c.flag) return false;
  while (!amk_mbar_try(c.pre->bar, parity)) {}  // this thread's own acquire of the copied bytes
  return true;
}

// Thread 0, before the block exits early: let an in-flight preload land (bounded).
__device__ __forceinline__ void amk_pre_drain(const AmkParams& p, const AmkPre& P) {
  if (AMK_PRE_DEVICE && P.n > 0) amk_mbar_drain(p, P.bar, (P.n - 1u) & 1u);
}
