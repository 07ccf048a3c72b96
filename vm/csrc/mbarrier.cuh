// Shared-memory mbarrier primitives of the sm_90+ bulk-copy paths (stream.cuh: the weight ring; preload.cuh: the
// whole-tile preload): init, expect_tx + cp.async.bulk global -> shared, try_wait on a phase parity, and a bounded
// wait that polls the abort flag and reports TIMEOUT. On older architectures they compile to nothing (the loader
// never flags a task for either path there).
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AMK_MBAR_DEVICE 1
#else
#define AMK_MBAR_DEVICE 0
#endif

#ifndef AMK_MBAR_POLL_NS
#define AMK_MBAR_POLL_NS 2000
#endif

__device__ __forceinline__ uint32_t amk_smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void amk_mbar_init(uint32_t bar) {
#if AMK_MBAR_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(1) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  (void)bar;
#endif
}

// Arms the barrier's current phase for `bytes` of bulk-copy data (one arrival: the caller's).
__device__ __forceinline__ void amk_mbar_expect(uint32_t bar, uint32_t bytes) {
#if AMK_MBAR_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
#else
  (void)bar; (void)bytes;
#endif
}

// One 1-D bulk copy global -> shared (16-byte aligned, size a multiple of 16) completing on `bar`.
__device__ __forceinline__ void amk_bulk_g2s(uint32_t dst, uint64_t src, uint32_t bytes, uint32_t bar, uint64_t pol) {
#if AMK_MBAR_DEVICE
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
#else
  (void)dst; (void)src; (void)bytes; (void)bar; (void)pol;
#endif
}

__device__ __forceinline__ bool amk_mbar_try(uint32_t bar, uint32_t parity) {
#if AMK_MBAR_DEVICE
  uint32_t ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0;
#else
  (void)bar; (void)parity;
  return true;
#endif
}

// One thread: wait for phase `parity` of `bar`. 0 = done; 1 = stop: *stop raised (if given; checked on every
// poll), abort seen, or timed out (reported as a TIMEOUT of task `task` / opcode `op` with counter field `detail`, a
// negative number naming the barrier).
// gate (if given): the phase is looked at only once *gate - gate_after > 0 (wrapping uint32 counts). A parity names
// one of two phases, so a waiter that may run two or more phases ahead of the barrier (the ring's consumers: a warp
// may wait for stage n + AMK_STAGES before stage n has landed) must first know that its phase is the current one --
// the ring's count of issued stages says so.
// kSite: AMK_RING_WG builds give the ring producer its own copy (1): ptxas ignores setmaxnreg (C7507) when a noinline
// function is called from regions with different register limits (common.cuh AMK_RING_WG); elsewhere one copy (0).
template <int kSite = 0>
__device__ __noinline__ int amk_mbar_wait_for(const AmkParams& p, uint32_t bar, uint32_t parity, int task, int op,
                                              int detail, int sm, const volatile int* stop,
                                              const volatile uint32_t* gate = nullptr, uint32_t gate_after = 0) {
  const auto ready = [&] {
    return (gate == nullptr || (int32_t)(*gate - gate_after) > 0) && amk_mbar_try(bar, parity);
  };
  if (ready()) return 0;
  uint64_t t0, tc;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  tc = t0;
  for (;;) {
    if (ready()) return 0;
    if (stop != nullptr && *stop) return 1;
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    // The abort flag at most once per AMK_MBAR_POLL_NS: every compute warp of every block may wait here (the weight
    // ring), and ~2000 threads loading one L2 line back to back slow the whole memory system.
    if (t - tc < AMK_MBAR_POLL_NS) continue;
    tc = t;
    int ab;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(ab) : "l"(p.status + AMK_STATUS_ABORT) : "memory");
    if (ab) return 1;
    if ((int64_t)(t - t0) > p.timeout_ns) {
      amk_report(p, AMK_ERR_TIMEOUT, task, op, detail, sm);
      return 1;
    }
  }
}
// The same for the instruction `in` running on this block, with no stop flag.
__device__ __forceinline__ int amk_mbar_wait(const AmkParams& p, uint32_t bar, uint32_t parity, const AmkInstr& in,
                                             int detail, int sm) {
  return amk_mbar_wait_for(p, bar, parity, in.task_id, in.op, detail, sm, nullptr);
}

// One thread, before the block exits early: wait (bounded by the timeout, no report) until phase `parity` of `bar`
// completes, so no bulk copy into this block's shared memory outlives the block.
__device__ __forceinline__ void amk_mbar_drain(const AmkParams& p, uint32_t bar, uint32_t parity) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    if (amk_mbar_try(bar, parity)) return;
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if ((int64_t)(t - t0) > p.timeout_ns) return;
  }
}
