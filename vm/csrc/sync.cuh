// Inter-block synchronisation of the megakernel: acquire waits with backoff + timeout, release increments,
// and L2 weight prefetch issued before a block spins (weights never wait on activations).
//
// Protocol (schedule/ir.py): counters start at 0 each launch. Producer: amk_sync(); thread 0 does a
// gpu-scope release add (cumulative over the block's writes ordered by the barrier). Consumer: thread 0 spins
// with gpu-scope acquire loads until counter >= threshold, then amk_sync(); data is then read with __ldcg.
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

// Thread 0, while a task spins on an unsatisfied wait: weights never wait on activations, so the HBM works for this
// SM meanwhile. The ranges, in order: the head of the task's own weight ranges (p.wait_prefetch_bytes in all, knob
// wait_prefetch_kb; none for a preloaded tile, already on its way), then the head of the NEXT queued task's
// (p.wait_prefetch_next_bytes, knob wait_prefetch_next_kb). Tasks whose waits are already satisfied issue nothing:
// no extra traffic competes with SMs that are streaming. p.wait_prefetch_pace_bytes > 0 spreads the requests over
// the polls (that many bytes per poll) instead of one burst. On llama-3.2-1b (H100 and H200) both the next-task
// prefetch and the pacing measured slower (docs/PERF.md, seventeenth session): the knobs default to off.
//
// The state is one number, the bytes requested so far: every poll walks the (at most 2 * AMK_MAX_PREFETCH) ranges
// again from the instruction copies (shared memory / L1), so nothing stays live in amk_wait_all's registers.
// amk_pf_ranges calls f(base, bytes) for each range of one instruction in order (16-byte aligned, trimmed inward).
// GLOBAL: `in` points into p.instrs (read-only for the launch: __ldg), else it is the task's shared-memory copy.
template <bool GLOBAL, class F>
__device__ __forceinline__ void amk_pf_ranges(const AmkInstr* in, int64_t cap, F f) {
  auto ld64 = [&](const void* q) -> uint64_t {
    return GLOBAL ? (uint64_t)__ldg((const unsigned long long*)q) : *(const uint64_t*)q;
  };
  const int flags = GLOBAL ? __ldg(&in->flags) : in->flags;
  if (cap <= 0 || (flags & AMK_INSTR_FLAG_PRELOAD)) return;  // a preloaded tile is already on its way
  const int nr = (int64_t)ld64(&in->prefetch_bytes[1]) > 0 ? 2 : 1;
  for (int k = 0; k < nr && k < AMK_MAX_PREFETCH; ++k) {
    const uint64_t ptr = ld64(&in->prefetch_ptr[k]);
    int64_t bytes = (int64_t)ld64(&in->prefetch_bytes[k]);
    if (bytes > cap / nr) bytes = cap / nr;
    if (ptr == 0 || bytes <= 0) continue;
    const uint64_t base = (ptr + 15) & ~15ull;
    bytes = (int64_t)(((ptr + (uint64_t)bytes) & ~15ull) - base);
    if (bytes > 0) f(base, bytes);
  }
}
// Requests the bytes [done, done + budget) of the concatenated ranges (budget <= 0: all that remain), one bulk
// prefetch per <= 16 KB piece. Returns the new `done`. Only called while a wait spins (not inlined into the entry
// path of every task).
__device__ __noinline__ int64_t amk_wait_pf(const AmkParams& p, const AmkInstr& in, const int32_t* next_item,
                                            int64_t done, int64_t budget) {
  const int64_t end = budget > 0 ? done + budget : INT64_MAX;
  int64_t at = 0;  // start of the current range in the concatenation
  auto issue = [&](uint64_t base, int64_t bytes) {
    for (int64_t o = done - at > 0 ? done - at : 0; o < bytes && at + o < end;) {
      int64_t sz = bytes - o < 16384 ? bytes - o : 16384;
      if (at + o + sz > end) sz = end - at - o;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(base + o), "r"((unsigned)sz) : "memory");
#else
      for (int64_t b = 0; b < sz; b += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"(base + o + b));
#endif
      o += sz;
      done = at + o;
    }
    at += bytes;
  };
  amk_pf_ranges<false>(&in, p.wait_prefetch_bytes, issue);
  if (next_item != nullptr && p.wait_prefetch_next_bytes > 0)
    amk_pf_ranges<true>(p.instrs + __ldg(next_item), p.wait_prefetch_next_bytes, issue);
  return at > done ? done : INT64_MAX;  // INT64_MAX: nothing left
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
// AMK_DBG_NOWAIT (diagnostic builds only, wrong results): every wait counts as met at once, so a launch times
// what the queues cost with no dependency hop at all (scripts/ab_builds.py `diag:` variants; docs/PERF.md).
// AMK_DBG_NOWAIT_OPS: the same for the tasks whose opcode's bit is set (1 << AMK_OP_...): what one hop family costs.
#ifndef AMK_DBG_NOWAIT
#define AMK_DBG_NOWAIT 0
#endif
#ifndef AMK_DBG_NOWAIT_OPS
#define AMK_DBG_NOWAIT_OPS 0
#endif
// Joined waits (AMK_JOIN_OPS: opcodes, bit 1 << AMK_OP_...). The task loop's wait of such a task takes its first
// look at its counters as any wait does (one round trip, while the other warps prepare the task as usual); if they
// are met the op runs as any other, else the wait is deferred to the op at the first unmet counter: the op runs
// its input-independent setup first and waits at its first read of an input (amk_join) -- so on the dependency
// chain the op's setup (dispatch, noinline calls, ranges, geometry: ~2 us for an attention split, docs/PERF.md)
// overlaps the wait instead of following it, while a task whose inputs are already there reaches its op as before
// (the thirtieth session's design A ran the setup before every first poll and delayed those by ~1.5 us). Contract:
// every path of a joined op either calls amk_join exactly once, before it reads anything a producer writes, or
// fails (amk_fail: the block stops, nothing is signalled).
// State: amk_s_join = 1 while a deferred wait is pending; amk_s_join_next = the next task's queue slot (prefetch).
#ifndef AMK_JOIN_OPS
#define AMK_JOIN_OPS ((1 << AMK_OP_ATTN_DECODE) | (1 << AMK_OP_ATTN_PARTIAL) | (1 << AMK_OP_ATTN_MERGE))
#endif
__shared__ int amk_s_join;
__shared__ const int32_t* amk_s_join_next;

// ---------------------------------------------------------------------------------------------------------------
// Data-flagged activations (knob flag_hops; schedule/validate.py proves the rules). A flagged fp32 buffer
// (AMK_DTYPE_F32X) holds element i as the 8-byte word bits(value) | tag << 32. Its producer stores each word with
// one relaxed 8-byte store (no fence, no counter wait downstream); a reader polls the words it needs until each
// carries this launch's tag, so the data and its readiness arrive in one round trip (NCCL's "LL" idea; the
// seventeenth session's hop_micro: a hop -0.4 us alone, -1.9 us while other SMs stream). The tag is the launch
// epoch + 1 (status word AMK_STATUS_EPOCH, advanced by each launch's last block, amk_exit), so every word of the
// last launch is stale, and the validator lets each flagged element be written at most once per launch. A task's
// waits that only order such data (AMK_INSTR_FLAG_WAIT_DATA0 << w) do not spin: amk_wait_all looks at the
// counter once and, if unmet, asks L2 for the task's weights as any wait does; the producer still signals it.
// Measured slower than the counters on an H100 (llama-3.2-1b +0.6..+2.7%: a phase still waits for its slowest tile,
// docs/PERF.md forty-seventh session), so flag_hops is off by default.
// ---------------------------------------------------------------------------------------------------------------
// AMK_FLAGS (vm/jit.py BuildSpec.flags): compiled in only for programs with flagged buffers (the loader's choice),
// so every other build's machine code is the one without them.
#ifndef AMK_FLAGS
#define AMK_FLAGS 0
#endif
__shared__ uint32_t amk_s_tag;  // this launch's tag (thread 0 sets it before the kernel's first barrier)
// Backoff of a flagged poll (every thread polls its own words: far more requests than thread 0's counter poll).
#ifndef AMK_FLAG_NS_MIN
#define AMK_FLAG_NS_MIN AMK_POLL_NS_MIN
#endif
#ifndef AMK_FLAG_NS_MAX
#define AMK_FLAG_NS_MAX AMK_POLL_NS_MAX
#endif
#define AMK_FLAG_DETAIL (-101)  // TIMEOUT detail word: a flagged input never got this launch's tag (vm/pack.py)

__device__ __forceinline__ void amk_st_flag(float* base, int64_t i, float v) {
  const uint64_t w = ((uint64_t)amk_s_tag << 32) | (uint64_t)__float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"((uint64_t*)base + i), "l"(w) : "memory");
}
__device__ __forceinline__ bool amk_slot_flagged(const AmkCtx& c, int slot) {
  return AMK_FLAGS && amk_dtype(c, slot) == AMK_DTYPE_F32X;
}
// An fp32 output slot: plain or data-flagged (AMK_PUT(o, i, v) stores element i either way). In builds without
// AMK_FLAGS it is the plain pointer and AMK_PUT the plain store expression, so those builds' machine code is the one
// from before flags existed (checked: the default llama-3.2-1b build's SASS, docs/PERF.md forty-seventh session).
#if AMK_FLAGS
struct AmkOut {
  float* p;
  bool flagged;
};
template <class I>
__device__ __forceinline__ void amk_put(const AmkOut& o, I i, float v) {
  if (o.flagged) amk_st_flag(o.p, i, v);
  else o.p[i] = v;
}
__device__ __forceinline__ float* amk_out_ptr(const AmkOut& o) { return o.p; }
__device__ __forceinline__ AmkOut amk_out(const AmkCtx& c, int slot) {
  return AmkOut{(float*)amk_ptr(c, slot), amk_slot_flagged(c, slot)};
}
#define AMK_PUT(o, i, v) amk_put((o), (i), (v))
#else
typedef float* AmkOut;
#define AMK_PUT(o, i, v) ((o)[i] = (v))
__device__ __forceinline__ float* amk_out_ptr(AmkOut o) { return o; }
__device__ __forceinline__ AmkOut amk_out(const AmkCtx& c, int slot) { return (float*)amk_ptr(c, slot); }
#endif
// Element e of an fp32 slot, plain (4 bytes) or flagged (8).
__device__ __forceinline__ const void* amk_elem_ptr(const AmkCtx& c, int slot, int64_t e) {
  return (const char*)amk_ptr(c, slot) + e * (amk_slot_flagged(c, slot) ? 8 : 4);
}
__device__ __forceinline__ void amk_ld_flag2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ uint64_t amk_ld_flag(const uint64_t* p) {
  uint64_t a;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(a) : "l"(p) : "memory");
  return a;
}
// The slow path of a flagged read: polls words w[0..n) (n <= 4; 16-byte aligned when vec) until each carries the
// launch's tag, with the waits' backoff, abort flag and timeout. false: stop (aborted, or timed out and reported;
// *c.flag is set for the op's next barrier).
__device__ __noinline__ bool amk_poll_flags_slow(const AmkCtx& c, const uint64_t* p, int n, bool vec, uint64_t* w) {
  const uint32_t tag = amk_s_tag;
  const uint64_t t0 = amk_globaltimer();
  unsigned ns = AMK_FLAG_NS_MIN;
  for (int it = 0;; ++it) {
    if (AMK_FLAG_NS_MAX > 0) {
      __nanosleep(ns);
      if (ns < AMK_FLAG_NS_MAX) ns <<= 1;
    }
    bool ok = true;
    for (int k = 0; k < n; k += vec ? 2 : 1) {
      if (vec) amk_ld_flag2(p + k, w[k], w[k + 1]);
      else w[k] = amk_ld_flag(p + k);
      ok = ok && (uint32_t)(w[k] >> 32) == tag && (!vec || (uint32_t)(w[k + 1] >> 32) == tag);
    }
    if (ok) return true;
    if ((it & 15) == 15) {  // another thread of the block gave up, or another block failed: stop too
      if (*(volatile int*)c.flag || amk_ld_relaxed(c.p->status + AMK_STATUS_ABORT)) { *c.flag = 1; return false; }
      if ((int64_t)(amk_globaltimer() - t0) > c.p->timeout_ns) {
        amk_fail(c, AMK_ERR_TIMEOUT, AMK_FLAG_DETAIL);
        return false;
      }
    }
  }
}
// 4 consecutive flagged elements at p (16-byte aligned) into v; false: stop (see amk_poll_flags_slow).
__device__ __forceinline__ bool amk_ld_flagged4(const AmkCtx& c, const uint64_t* p, float4& v) {
  uint64_t w[4];
  amk_ld_flag2(p, w[0], w[1]);
  amk_ld_flag2(p + 2, w[2], w[3]);
  const uint32_t tag = amk_s_tag;
  bool ok = (uint32_t)(w[0] >> 32) == tag && (uint32_t)(w[1] >> 32) == tag && (uint32_t)(w[2] >> 32) == tag &&
            (uint32_t)(w[3] >> 32) == tag;
  if (!ok) ok = amk_poll_flags_slow(c, p, 4, true, w);
  v = make_float4(__uint_as_float((uint32_t)w[0]), __uint_as_float((uint32_t)w[1]), __uint_as_float((uint32_t)w[2]),
                  __uint_as_float((uint32_t)w[3]));
  return ok;
}
// One flagged element; false: stop.
__device__ __forceinline__ bool amk_ld_flagged1(const AmkCtx& c, const uint64_t* p, float& v) {
  uint64_t w = amk_ld_flag(p);
  bool ok = (uint32_t)(w >> 32) == amk_s_tag;
  if (!ok) ok = amk_poll_flags_slow(c, p, 1, false, &w);
  v = __uint_as_float((uint32_t)w);
  return ok;
}

// next_item: the queue slot holding the next task's instruction index (nullptr: this is the block's last task).
// may_join: the task loop's call (a joined op's wait may be deferred); amk_join's call waits.
__device__ __noinline__ int amk_wait_all(const AmkParams& p, const AmkInstr& in, const int32_t* next_item, int sm,
                                         bool may_join = false) {
  int aborted = amk_ld_relaxed(p.status + AMK_STATUS_ABORT);
  if (AMK_DBG_NOWAIT || ((AMK_DBG_NOWAIT_OPS >> (in.op & 31)) & 1)) return aborted;
  if (!AMK_WAIT_OVERLAP && aborted) return 1;
  const int nw = in.n_waits < AMK_MAX_WAITS ? in.n_waits : AMK_MAX_WAITS;
  const bool defer = AMK_JOIN_OPS && may_join && ((AMK_JOIN_OPS >> (in.op & 31)) & 1);
  if (AMK_JOIN_OPS && may_join) amk_s_join = 0;
  // bytes of the prefetch ranges requested so far (INT64_MAX: all). A task whose weights stream through the ring
  // (stream.cuh: its producer copies them, possibly long before this wait) asks L2 for nothing.
  int64_t pf_done = amk_task_streams(in) ? INT64_MAX : 0;
  const int64_t pace = p.wait_prefetch_pace_bytes;
  for (int w = 0; w < nw; ++w) {
    const int c = in.wait_counter[w], thr = in.wait_threshold[w];
    const int32_t* ctr = p.counters + c;
    const int v = amk_ld_acquire(ctr);
    if (aborted) return 1;
    if (v >= thr) continue;
    if (AMK_FLAGS && (in.flags & (AMK_INSTR_FLAG_WAIT_DATA0 << w))) {  // the op polls its flagged inputs itself
      if (pf_done != INT64_MAX) pf_done = amk_wait_pf(p, in, next_item, pf_done, 0);
      continue;
    }
    if (defer) {  // the op waits (amk_join), after its setup
      amk_s_join = 1;
      amk_s_join_next = next_item;
      return 0;
    }
    const uint64_t t0 = amk_globaltimer();
    unsigned ns = AMK_POLL_NS_MIN;
    for (;;) {
      if (pf_done != INT64_MAX) pf_done = amk_wait_pf(p, in, next_item, pf_done, pace);  // pace 0: all at once
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

// Every thread of the block, once per joined op, before its first input read (see AMK_JOIN_OPS above). false: the
// block must stop (abort seen, or the wait timed out and was reported). Without a deferred wait: returns at once.
__device__ __forceinline__ bool amk_join(const AmkCtx& c) {
  if (!AMK_JOIN_OPS || amk_s_join != 1) return true;
  if (amk_tid() == 0) {
    *c.flag = amk_wait_all(*c.p, *c.ins, amk_s_join_next, c.sm);
    if (c.p->trace)  // "waits met" (the task loop stamped its check)
      c.p->trace[(size_t)c.instr_index * AMK_TRACE_WORDS + 1] = amk_globaltimer();
  }
  amk_sync();  // every thread has read amk_s_join (above) and sees the inputs thread 0 acquired
  if (amk_tid() == 0) amk_s_join = 2;  // read again only after the task loop's next barrier
  return *c.flag == 0;
}
