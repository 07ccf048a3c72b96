// The AMK megakernel: ONE cooperative persistent launch per decode step.
//
// Block b runs queue b (queue_items[queue_offsets[b] : queue_offsets[b+1]]) in order. Per task:
//   1. copy the instruction POD into shared memory; issue L2 prefetches for the weight ranges of the next
//      AMK_PREFETCH_DEPTH queued tasks (each range once, at most prefetch_cap bytes). On sm_90 builds with the
//      weight ring (stream.cuh) one more warp per block, the producer, streams the weights of the queue's streamed
//      tasks into the ring from the launch's start, in queue order -- weights never wait on activations;
//   2. thread 0 waits (acquire + backoff) until every wait counter reaches its threshold, polling the abort flag and
//      a %globaltimer budget (TIMEOUT names task + counter); meanwhile the other warps resolve the task's buffer
//      slots and IO scalars (token, pos) into shared memory, stage its fused RMSNorm weight (amk_prep_*) and
//      compute its shared-memory need, so the op starts with one dependent round trip (its input) instead of three
//      and almost nothing runs between the wait and that load (the build switches below); an attention task with
//      the early_kv hint 1 has its KV history rows issued into its stages (amk_attn_early); a task flagged
//      AMK_INSTR_FLAG_KV_AHEAD issues those of the NEXT task (an attention task with early_kv 2) into the stage
//      region at the top of shared memory (amk_kv_ahead, AMK_KV_AHEAD builds). A task of a joined op
//      (AMK_JOIN_OPS, sync.cuh: attention and merge) whose counters are not met at the first check defers the
//      wait into its op, which runs its setup first and waits at its first input read (amk_join);
//   3. dispatch on the opcode (unknown -> BAD_OPCODE); ops check their shared-memory need against the launch;
//   4. __syncthreads, then thread 0 release-increments out_counter. If the task used the preload buffer
//      (preload.cuh), the next flagged task's whole weight tile is bulk-copied into it from the start of the next
//      task on (issued by the producer thread while thread 0 waits).
// Any error writes the status words, raises the abort flag, and every block exits at its next wait.
//
// This translation unit includes no torch header: plain nvcc compiles it for sm_80 / sm_90a (CI does, with -c).
// The host entry points below (extern "C") are what binding.cpp calls.
#include <stddef.h>
#include "common.cuh"
#include "sync.cuh"
#include "stream.cuh"
#include "preload.cuh"
#include "ops_embed_norm.cuh"
#include "ops_attention.cuh"
#include "ops_gemv.cuh"
#include "ops_mlp.cuh"
#include "ops_qkv.cuh"
#include "ops_misc.cuh"
#include "dbg_splitk.cuh"

// Build switches of the task loop (all default on; -D...=0 restores the old code for A/Bs; docs/PERF.md, tenth
// session). Whatever every thread executes between the wait and the op's first load is paid once per phase per SM,
// with 4 warps per scheduler issuing it:
//   AMK_CTX_ONCE: the op context (AmkCtx, passed by reference to the noinline ops, so it lives on each thread's
//     stack) is built once per launch; per task only instr_index and nw are stored, before the wait. A fresh copy
//     per task was 15 8-byte stack stores per thread after the wait: 8-10% of a step.
//   AMK_NEED_EARLY: the task's shared-memory need is computed while thread 0 waits, not after the wait (-0.3% to
//     -0.9%).
//   AMK_PARAMS_SMEM: the launch params are copied into shared memory once per launch, and the noinline code
//     (amk_wait_all, the ops) reads them there. Through a pointer to the __grid_constant__ param, every field
//     read is a generic load; amk_wait_all needed one before it could even issue the abort-flag and counter loads
//     (-0.2% to -0.4% on top of the two above).
#ifndef AMK_PARAMS_SMEM
#define AMK_PARAMS_SMEM 1
#endif
#ifndef AMK_NEED_EARLY
#define AMK_NEED_EARLY 1
#endif
#ifndef AMK_CTX_ONCE
#define AMK_CTX_ONCE 1
#endif
// AMK_INSTR_AHEAD 1 (an A/B build switch, not yet timed): the next task's instruction is copied into shared
// memory (s_next) while the current task waits and runs -- 8-byte cp.async by warp 0's lanes 1-27, idle while
// thread 0 waits and never the issuers of the early-KV / KV-ahead copies that stay in flight across a task's end
// (threads 32 and up); their group is committed before the op's own, so the ops' wait-group counts still hold --
// and the task loop's head copies it from there. The default head reads the queue entry and then the instruction
// from global memory after the closing barrier (two dependent loads, L1 hits only if the L1 prefetch of the task
// before landed): the fifty-second
// session's trace has a median 0.5-1.0 us between one task's end and the next one's start, 2.4 us (p90) after an
// L2_PREFETCH task, whose bulk prefetches those loads queue behind -- and the o_proj tiles after such tasks end
// their phase. The queue entry of the next task is read one task ahead too.
#ifndef AMK_INSTR_AHEAD
#define AMK_INSTR_AHEAD 0
#endif
// AMK_DBG_TWICE_OPS (diagnostic builds only): the tasks whose opcode's bit (1 << AMK_OP_...) is set run their op twice
// (the task loop below).
#ifndef AMK_DBG_TWICE_OPS
#define AMK_DBG_TWICE_OPS 0
#endif
// AMK_LAYOUT_PAD N (A/B builds, scripts/ab_builds.py --pads): N never-executed volatile loads (~32 bytes of SASS
// each) at the top of the kernel body, so the task loop and every op function after it sit at other addresses.
// Kernel A/Bs of one build per variant carry a +-1-2.5% code-layout lottery (docs/PERF.md, twenty-eighth and
// twenty-ninth sessions); timing each variant under several pads averages it out.
#ifndef AMK_LAYOUT_PAD
#define AMK_LAYOUT_PAD 0
#endif
// AMK_DBG_TWICE_NOKV 1: the second run does not re-issue the early KV rows (wrong results, a `diag:` build): its q
// load then queues behind no copies, so its stage is a warm op's in a quiet SM.
#ifndef AMK_DBG_TWICE_NOKV
#define AMK_DBG_TWICE_NOKV 0
#endif
// AMK_OPS_MASK: the opcodes compiled into this build (bit 1 << AMK_OP_...; default all; the loader passes the
// program's own, vm/pack.py select_build). A task whose opcode is not compiled in fails as an unknown opcode
// (AMK_ERR_BAD_OPCODE). Leaving out the ops a program never runs cut the llama-3.2-1b build's SASS from 671 to
// 420 KB (with the trims of attn_common.cuh and AMK_GROUP_EARLY); H100 -0.3% over two code layouts, H200 equal
// (docs/PERF.md, forty-eighth session).
#ifndef AMK_OPS_MASK
#define AMK_OPS_MASK 0xFFFFFFFFu
#endif
#define AMK_HAS_OP(op) ((((unsigned)(AMK_OPS_MASK)) >> (op)) & 1u)
// one dispatch case: the op where it is compiled in, else the unknown-opcode failure
#define AMK_OP_CASE(OP, CALL) \
  case AMK_OP_##OP:           \
    if (AMK_HAS_OP(AMK_OP_##OP)) { CALL; break; } goto bad_op

// Dynamic shared memory (floats) an instruction needs; vm/smem.py mirrors this formula (smem_floats).
__device__ __forceinline__ int amk_smem_floats(const AmkInstr& in) {
  AmkGeom g;
  const int stash = amk_stream_geom(in, g) ? amk_pad4(amk_stash_floats(g)) : 0;
  switch (in.op) {
    case AMK_OP_RMSNORM: return amk_pad4(in.ip[AMK_RMSNORM_IP_N]);
    case AMK_OP_GEMV:
      return amk_pad4(in.ip[AMK_GEMV_IP_K]) + stash +
             (in.ip[AMK_GEMV_IP_HAS_RESIDUAL] ? amk_pad4(in.ip[AMK_GEMV_IP_ROW_COUNT]) : 0) +
             amk_pad4(amk_merged_x_floats(in));
    case AMK_OP_GEMV_SILU_MUL: return amk_pad4(in.ip[AMK_GEMV_SILU_MUL_IP_K]) + stash;
    case AMK_OP_GEMV_SILU_MUL_DOWN:  // x | the tile's SiLU*up rows (never streamed)
      return amk_pad4(in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_K]) + amk_pad4(in.ip[AMK_GEMV_SILU_MUL_DOWN_IP_ROW_COUNT]);
    case AMK_OP_QKV_ROPE:
      return amk_pad4(in.ip[AMK_QKV_ROPE_IP_K]) +
             amk_pad4(in.ip[AMK_QKV_ROPE_IP_HEAD_COUNT] * in.ip[AMK_QKV_ROPE_IP_HEAD_DIM]) + stash;
    case AMK_OP_QK_NORM_ROPE:
      return amk_pad4((in.ip[AMK_QK_NORM_ROPE_IP_GROUP] + 1) * in.ip[AMK_QK_NORM_ROPE_IP_HEAD_DIM]) +
             2 * in.ip[AMK_QK_NORM_ROPE_IP_HEAD_DIM] + amk_pad4(in.ip[AMK_QK_NORM_ROPE_IP_HEAD_DIM] / 2);
    case AMK_OP_ATTN_DECODE:
    case AMK_OP_ATTN_PARTIAL: {  // (AMK_KV_AHEAD: the stages are the region at the top, amk_smem_need)
      const AmkAttnSmem a = amk_attn_smem(in.ip[AMK_ATTN_DECODE_IP_GROUP], in.ip[AMK_ATTN_DECODE_IP_HEAD_DIM]);
      return AMK_KV_AHEAD ? a.kv : a.total;
    }
    default: return 0;
  }
}

// Bytes of dynamic shared memory a task needs: ring + preload buffer + its op area + its staged norm weight (+ the
// attention stage region at the top in AMK_KV_AHEAD builds, which every task must leave alone).
__device__ __forceinline__ int64_t amk_smem_need(const AmkParams& p, const AmkInstr& in) {
  return (int64_t)(amk_smem_floats(in) + amk_norm_floats(in)) * 4 + AMK_RING_BYTES + p.preload_bytes + AMK_KV_REGION;
}

// need: amk_smem_need of the task, computed before the wait (AMK_NEED_EARLY) or here.
__device__ __forceinline__ void amk_dispatch(const AmkCtx& c, int64_t need) {
  const int op = c.ins->op;
  if (!AMK_NEED_EARLY) need = amk_smem_need(*c.p, *c.ins);
  if (need > (int64_t)c.p->smem_bytes) {
    if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_INPUT, (int)need);
    return;
  }
  switch (op) {
    AMK_OP_CASE(EMBED, amk_op_embed(c));
    AMK_OP_CASE(RMSNORM, amk_op_rmsnorm(c));
    AMK_OP_CASE(GEMV, amk_dbg_splitk_pre(c); amk_op_gemv(c); amk_dbg_splitk(c));   // (diagnostic hooks: no-ops unless on)
    AMK_OP_CASE(GEMV_SILU_MUL, amk_op_gemv_silu_mul(c));
    AMK_OP_CASE(GEMV_SILU_MUL_DOWN, amk_op_gemv_silu_mul_down(c));
    AMK_OP_CASE(QKV_ROPE, amk_op_qkv_rope(c));
    AMK_OP_CASE(QK_NORM_ROPE, amk_op_qk_norm_rope(c));
    AMK_OP_CASE(ATTN_DECODE, amk_op_attn(c, false));
    AMK_OP_CASE(ATTN_PARTIAL, amk_op_attn(c, true));
    AMK_OP_CASE(ATTN_MERGE, amk_op_attn_merge(c));
    AMK_OP_CASE(ADD, amk_op_add(c));
    AMK_OP_CASE(ARGMAX, amk_op_argmax(c));
    AMK_OP_CASE(ARGMAX_PARTIAL, amk_op_argmax_partial(c));
    AMK_OP_CASE(ARGMAX_MERGE, amk_op_argmax_merge(c));
    AMK_OP_CASE(ARGMAX_PAIRS, amk_op_argmax_pairs(c));
    AMK_OP_CASE(L2_PREFETCH, amk_op_l2_prefetch(c));
    default:
    bad_op:
      if (amk_tid() == 0) amk_fail(c, AMK_ERR_BAD_OPCODE, c.instr_index);
      break;
  }
}

// Every block, once, as it leaves the launch (normally or on abort). Thread 0 counts the block out with an acq_rel
// add on the status word AMK_STATUS_EXITS (release: this block's writes and counter signals, ordered before it by
// the barrier; acquire: every earlier block's). The LAST block out (every task of the launch is done) then does
// the bookkeeping that used to be separate stream operations before each launch, so a decode step is one launch:
//   * resets the counters to 0 for the next launch (the host's memset before each launch: ~3 us of stream gap
//     per step on an H100, scripts/launch_gaps.py), and the exit count itself; advances the launch epoch (the
//     tag of the next launch's data-flagged activations, sync.cuh);
//   * stores the launch's given token / positions into their buffers (AMK_IO_TOKEN / AMK_IO_POS: pos[s] = in_pos
//     + s for its n_steps steps), or with AMK_IO_ADVANCE feeds the last step's output back: token =
//     next_token[n_steps-1], pos[s] = position + n_steps + s, and next_token[0..n_steps) into out_token (the
//     decode history slots) -- what the greedy decode loop did with three small kernels per step.
// After an abort nothing is reset or advanced: the counters stay as they were for the error report (the host
// reads the waited counter's value) and the host resets the whole sync array when it clears the error
// (vm/loader.py). The next launch cannot start before this one has finished, so the stores need no fence.
// kSite: the spare blocks' copy in AMK_RING_WG builds (1) is called before setmaxnreg, the other (0) after it -- one
// noinline function called from both would make ptxas ignore setmaxnreg (common.cuh AMK_RING_WG).
template <int kSite = 0>
__device__ __noinline__ void amk_exit(const AmkParams& p) {
  __shared__ int s_last;
  amk_sync();
  if (amk_tid() == 0) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(p.status + AMK_STATUS_EXITS)
                 : "memory");
    s_last = old == (int)gridDim.x - 1 && amk_ld_relaxed(p.status + AMK_STATUS_ABORT) == 0;
  }
  amk_sync();
  if (!s_last) return;
  for (int i = amk_tid(); i < p.n_counters; i += AMK_THREADS) p.counters[i] = 0;
  if (amk_tid() == 0) {
    p.status[AMK_STATUS_EXITS] = 0;
    if (AMK_FLAGS) {  // the next launch's data-flag tag is epoch + 1: never 0, which zeroed flagged buffers carry
      const unsigned e = (unsigned)p.status[AMK_STATUS_EPOCH] + 1u;
      p.status[AMK_STATUS_EPOCH] = (int)(e == 0xFFFFFFFFu ? 0u : e);
    }
    const int f = p.io_flags, n = p.n_steps;
    if (f & AMK_IO_ADVANCE) {  // (binding.cpp checks that flags come with the addresses)
      const int p0 = ((f & AMK_IO_POS) ? p.in_pos : *(volatile int*)p.pos) + n;
      *p.token = ((volatile const int*)p.next_token)[n - 1];
      for (int s = 0; s < n; ++s) {
        p.pos[s] = p0 + s;
        if (p.out_token != nullptr) p.out_token[s] = ((volatile const int*)p.next_token)[s];
      }
    } else {
      if (f & AMK_IO_TOKEN) *p.token = p.in_token;
      if (f & AMK_IO_POS)
        for (int s = 0; s < n; ++s) p.pos[s] = p.in_pos + s;
    }
  }
}

// -DAMK_LB_THREADS=N (A/B builds): compile for blocks of N threads (register cap 64K / N, rounded to the scheduler
// split: 544 -> 96 registers) while launching AMK_BLOCK_THREADS -- the register path at a ring build's register cap.
#ifndef AMK_LB_THREADS
#define AMK_LB_THREADS AMK_BLOCK_THREADS
#endif
static_assert(AMK_LB_THREADS >= AMK_BLOCK_THREADS && AMK_LB_THREADS <= 1024, "AMK_LB_THREADS: the block .. 1024");
extern "C" __global__ void __launch_bounds__(AMK_LB_THREADS, 1) amk_megakernel(const __grid_constant__ AmkParams p) {
  __shared__ AmkInstr s_ins;
#if AMK_INSTR_AHEAD
  __shared__ __align__(16) AmkInstr s_next;  // the next task's instruction, landing while this one runs
#endif
  __shared__ float s_red[64];
  __shared__ float s_part[64];
  __shared__ int s_flag;
  __shared__ AmkRing s_ring;
  __shared__ __align__(8) uint64_t s_bars[AMK_STAGES];   // the ring's full barriers
  __shared__ __align__(8) uint64_t s_ebars[AMK_STAGES];  // and its empty barriers
  __shared__ AmkPre s_pre;
  __shared__ AmkSlot s_slots[AMK_MAX_BUFS];
  __shared__ __align__(8) uint64_t s_pre_bar;
  __shared__ __align__(16) AmkParams s_params;
  __shared__ int64_t s_need;
  const int sm = (int)blockIdx.x;
  if (sm >= p.n_queues) {  // (the host launches one block per queue; a spare block only counts itself out)
    if (amk_warp() >= AMK_NWARPS) return;  // (ring builds: the producer warp)
    amk_exit<AMK_RING_WG>(p);
    return;
  }
#if AMK_LAYOUT_PAD > 0
  if (p.n_queues < 0) {  // never taken: dead code that moves everything after it (see AMK_LAYOUT_PAD above)
    unsigned x = 0;
#pragma unroll
    for (int i = 0; i < AMK_LAYOUT_PAD; ++i) x += *((volatile const unsigned*)p.status + i);
    *(volatile int*)p.status = (int)x;
  }
#endif
  static_assert(sizeof(AmkParams) % 4 == 0, "AmkParams must be a whole number of words");
  if (AMK_PARAMS_SMEM)
    for (int i = amk_tid(); i < (int)(sizeof(AmkParams) / 4); i += AMK_THREADS)
      ((int*)&s_params)[i] = ((const int*)&p)[i];
  const AmkParams& P = AMK_PARAMS_SMEM ? s_params : p;  // what noinline code reads (published by the barrier below)
  const int q0 = p.queue_offsets[sm], q1 = p.queue_offsets[sm + 1];
  static_assert(sizeof(AmkInstr) % 4 == 0, "AmkInstr must be a whole number of words");
  constexpr int kWords = (int)(sizeof(AmkInstr) / 4);
  unsigned char* pre_buf = amk_dyn_smem + AMK_RING_BYTES;
  if (amk_tid() == 0) {
    amk_ring_init(s_ring, s_bars, s_ebars, amk_dyn_smem);
    if (AMK_FLAGS) amk_s_tag = (uint32_t)__ldcg(p.status + AMK_STATUS_EPOCH) + 1u;  // this launch's flag tag
  }
  if (amk_tid() == AMK_PRE_THREAD) amk_pre_init(p, s_pre, &s_pre_bar, pre_buf, q0, q1);  // first flagged tile
#if AMK_INSTR_AHEAD
  int idx_next = q0 < q1 ? p.queue_items[q0] : -1;  // the queue entry of the task the loop starts next
  if (q0 < q1) {
    const int* first = (const int*)(p.instrs + idx_next);
    for (int i = amk_tid(); i < kWords; i += AMK_THREADS) ((int*)&s_next)[i] = __ldg(first + i);
  }
#endif
  __syncthreads();  // (every thread of the block, the ring's producer warp too)
  if (AMK_TMA && amk_warp() >= AMK_NWARPS) {  // the ring's producer warp: the block's weight stream, then done
#if AMK_RING_WG  // (common.cuh: the producer warpgroup gives its registers to the compute warpgroups)
    amk_setmaxnreg<false, AMK_RING_WG_PRODUCER_REGS>();
#endif
    if ((!AMK_RING_WG || amk_warp() == AMK_NWARPS) && amk_lane() == 0) amk_ring_produce(p, s_ring, q0, q1, sm);
    return;
  }
#if AMK_RING_WG
  amk_setmaxnreg<true, AMK_RING_WG_COMPUTE_REGS>();
#endif
#if AMK_PREFETCH_DEPTH > 0
  int pf = q0;  // next queue position whose weights have not been L2-prefetched
#endif
  float* op_smem = (float*)(pre_buf + p.preload_bytes);
  // The ops take the context by reference, so it lives on the stack: built once, and per task only instr_index and
  // nw change (AMK_CTX_ONCE above). A copy in shared memory instead measured 1.4-3.1% slower than the stack one.
  AmkCtx c{&P, &s_ins, op_smem, s_red, s_part, &s_flag, sm, 0,
           &s_ring, amk_dyn_smem, q1, &s_pre, pre_buf, s_slots, nullptr};
  for (int qi = q0; qi < q1; ++qi) {
#if AMK_INSTR_AHEAD
    const int idx = idx_next;
    idx_next = qi + 1 < q1 ? p.queue_items[qi + 1] : -1;  // (used in the wait section and by the next head)
    for (int i = amk_tid(); i < kWords; i += AMK_THREADS) ((int*)&s_ins)[i] = ((const int*)&s_next)[i];
#else
    const int idx = p.queue_items[qi];
    const int* src = (const int*)(p.instrs + idx);
    if (amk_tid() < 2 && qi + 1 < q1) {  // the next instruction (2 x 128 B lines) into L1 while this task runs
      const char* nxt = (const char*)(p.instrs + p.queue_items[qi + 1]) + 128 * amk_tid();
      asm volatile("prefetch.global.L1 [%0];" :: "l"(nxt));
    }
    for (int i = amk_tid(); i < kWords; i += AMK_THREADS) ((int*)&s_ins)[i] = __ldg(src + i);
#endif
#if AMK_PREFETCH_DEPTH > 0
    const int pf_end = (qi + 1 + AMK_PREFETCH_DEPTH) < q1 ? (qi + 1 + AMK_PREFETCH_DEPTH) : q1;
    for (; pf < pf_end; ++pf) amk_prefetch_instr(p.instrs + p.queue_items[pf], p.prefetch_cap);
#endif
    amk_sync();
    float* const nw = op_smem + amk_smem_floats(s_ins);  // the staged norm weight follows the op's area
    if (AMK_CTX_ONCE) {
      c.instr_index = idx;
      c.nw = nw;
    }
    uint64_t* const trace = p.trace ? p.trace + (size_t)idx * AMK_TRACE_WORDS : nullptr;  // this task's record
    if (amk_tid() == 0) {
      if (trace) trace[0] = amk_globaltimer();  // stored at once: nothing of it stays live across the op call
      s_flag = amk_wait_all(P, s_ins, qi + 1 < q1 ? p.queue_items + qi + 1 : nullptr, sm, true);
      if (trace) trace[1] = amk_globaltimer();
    } else {  // while thread 0 waits: everything of the task that does not depend on its inputs
#if AMK_INSTR_AHEAD
      static_assert(sizeof(AmkInstr) % 8 == 0 && sizeof(AmkInstr) / 8 <= 31, "AMK_INSTR_AHEAD: 8 bytes per lane 1..");
      if (amk_tid() <= (int)(sizeof(AmkInstr) / 8) && idx_next >= 0) {  // warp 0's lanes 1.. (s_next is free now)
        const int w = amk_tid() - 1;  // (instructions sit 8-byte aligned: 216-byte records)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(amk_smem_addr((uint64_t*)&s_next + w)),
                     "l"((const uint64_t*)(p.instrs + idx_next) + w)
                     : "memory");
        amk_cp_async_commit();
      }
#endif
      if (AMK_PRE_DEVICE && amk_tid() == AMK_PRE_THREAD && s_ins.next_preload >= 0)
        amk_pre_issue(p, s_pre, s_ins.next_preload);  // the buffer is free: the loader picked this task
      if (amk_warp() == AMK_NWARPS - 1) amk_prep_slots(p, s_ins, s_slots, amk_lane());
      if (amk_tid() >= 32) {
        const int64_t need = amk_smem_need(p, s_ins);
        if (AMK_NEED_EARLY && amk_tid() == 32) s_need = need;
        if (need <= (int64_t)p.smem_bytes) amk_prep_norm(p, s_ins, nw, 32);  // else dispatch reports it
        if (amk_attn_early_hint(s_ins)) {
          asm volatile("bar.sync 1, %0;" ::"n"(AMK_THREADS - 32) : "memory");  // warp NWARPS-1's slots are published
          if (need <= (int64_t)p.smem_bytes) amk_attn_early(c, 32);  // the KV history rows start moving now
        }
#if AMK_KV_AHEAD
        // the next task's KV history into the top region (loader: only where the next task is an early_kv 2
        // attention task and this task's op issues no cp.async of its own)
        if (s_ins.flags & AMK_INSTR_FLAG_KV_AHEAD) amk_kv_ahead(P, qi + 1, 32);  // (never a queue's last task)
#endif
      }
    }
    amk_sync();
    if (s_flag) {
      if (amk_tid() == 0) { s_ring.stop = 1; amk_pre_drain(p, s_pre); }  // (the producer drains its copies)
      amk_cp_async_wait<0>();  // KV rows amk_attn_early issued land before the block exits
      break;
    }
    const int out_ctr = s_ins.out_counter;
    AmkCtx ci_fresh = c;
    if (!AMK_CTX_ONCE) {
      ci_fresh.instr_index = idx;
      ci_fresh.nw = nw;
    }
    const AmkCtx& ci = AMK_CTX_ONCE ? c : ci_fresh;
    amk_mark(ci, 0);
    amk_dispatch(ci, AMK_NEED_EARLY ? s_need : 0);
#if AMK_DBG_TWICE_OPS
    // Diagnostic (docs/PERF.md, twenty-eighth session): the ops whose bit is set run a second time, back to back,
    // on the same inputs (every op of the default programs is idempotent), so a marks trace times a run whose code,
    // TLB entries and data are warm against the first. The early KV rows are issued again (the first run's
    // cross-warp merge overwrote the stages).
    if ((AMK_DBG_TWICE_OPS >> s_ins.op) & 1) {
      amk_sync();
      if (!s_flag) {
        if (!AMK_DBG_TWICE_NOKV && amk_attn_early_hint(s_ins)) amk_attn_early(ci, 0);
        amk_mark(ci, 0);
        amk_dispatch(ci, AMK_NEED_EARLY ? s_need : 0);
      }
    }
#endif
#if AMK_INSTR_AHEAD
    if (amk_tid() > 0 && amk_tid() <= (int)(sizeof(AmkInstr) / 8)) amk_cp_async_wait<0>();  // s_next has landed
#endif
    amk_sync();
    if (!AMK_DBG_ATTN_STAGE_MARKS || (s_ins.op != AMK_OP_ATTN_PARTIAL && s_ins.op != AMK_OP_ATTN_DECODE))
      amk_mark(ci, 3);  // (the stage-marks diagnostic keeps an attention task's mark 3 inside its stage)
    if (s_flag) {
      if (amk_tid() == 0) { s_ring.stop = 1; amk_pre_drain(p, s_pre); }
      amk_cp_async_wait<0>();  // (a joined attention task that stopped at its wait has early KV rows in flight)
      break;
    }
    if (amk_tid() == 0) {
      if (out_ctr >= 0) amk_signal(p.counters + out_ctr);
      if (p.trace) {
        uint64_t* t = p.trace + (size_t)idx * AMK_TRACE_WORDS;
        t[2] = amk_globaltimer();
        unsigned smid;  // the physical SM (high word) next to the queue (low word): placement studies
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        t[3] = (uint64_t)sm | ((uint64_t)smid << 32);
      }
    }
  }
  amk_exit(p);
}

// ---------------------------------------------------------------------------------------------------------------
// Host entry points (no torch): binding.cpp calls these.
// ---------------------------------------------------------------------------------------------------------------
static int g_smem_prepared = -1;

// AMK_SMEM_CARVEOUT (percent, -1 = the driver's choice): the shared-memory share of the L1/shared storage. A
// diagnostic switch: the kernel needs its L1 (per-thread stacks, instruction PODs); on an H100 100 measured +7% and
// 50 +0.6% against the driver's choice (docs/PERF.md, sixteenth session).
#ifndef AMK_SMEM_CARVEOUT
#define AMK_SMEM_CARVEOUT -1
#endif
extern "C" int amk_prepare(int smem_bytes) {
  if (smem_bytes <= g_smem_prepared) return 0;
  if (AMK_SMEM_CARVEOUT >= 0)
    cudaFuncSetAttribute(amk_megakernel, cudaFuncAttributePreferredSharedMemoryCarveout, AMK_SMEM_CARVEOUT);
  const cudaError_t e =
      cudaFuncSetAttribute(amk_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e == cudaSuccess) g_smem_prepared = smem_bytes;
  return (int)e;
}

// amk_launch's own refusal (not a cudaError_t; amk_error_string names it).
#define AMK_LAUNCH_ERR_REG_POOL 100001

extern "C" int amk_launch(const AmkParams* p, int grid, int smem_bytes, void* stream) {
  if (smem_bytes > g_smem_prepared) {
    const int e = amk_prepare(smem_bytes);
    if (e) return e;
  }
#if AMK_RING_WG
  static int pool_ok = -1;  // (checked once: the kernel's register count is fixed by its build)
  if (pool_ok < 0) {  // the compute warpgroups' setmaxnreg.inc assumes a pool of AMK_RING_WG_LAUNCH_REGS each
    cudaFuncAttributes fa;
    const cudaError_t e = cudaFuncGetAttributes(&fa, amk_megakernel);
    if (e != cudaSuccess) return (int)e;
    pool_ok = fa.numRegs == AMK_RING_WG_LAUNCH_REGS;
  }
  if (!pool_ok) return AMK_LAUNCH_ERR_REG_POOL;
#endif
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid, 1, 1);
  cfg.blockDim = dim3(AMK_BLOCK_THREADS, 1, 1);
  cfg.dynamicSmemBytes = (size_t)smem_bytes;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // all blocks co-resident (or the launch fails)
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, amk_megakernel, *p);
}

extern "C" int amk_occupancy(int smem_bytes, int* blocks_per_sm) {
  const int e = amk_prepare(smem_bytes);
  if (e) return e;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, amk_megakernel, AMK_BLOCK_THREADS,
                                                            (size_t)smem_bytes);
}

#define AMK_LAYOUT_ROW(S, F, V) {#S, #F, (long long)(V)},
static const struct {
  const char* s;
  const char* f;
  long long v;
} kAmkLayout[] = {AMK_LAYOUT_ENTRIES(AMK_LAYOUT_ROW)};
#undef AMK_LAYOUT_ROW

extern "C" int amk_layout(const char** structs, const char** fields, long long* values, int max_entries) {
  const int n = (int)(sizeof(kAmkLayout) / sizeof(kAmkLayout[0]));
  for (int i = 0; i < n && i < max_entries; ++i) {
    structs[i] = kAmkLayout[i].s;
    fields[i] = kAmkLayout[i].f;
    values[i] = kAmkLayout[i].v;
  }
  return n;
}

extern "C" int amk_build_info(int* out, int n) {
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  const int v[14] = {AMK_THREADS, AMK_PREFETCH_DEPTH, AMK_ABI_VERSION, rt, (int)sizeof(AmkParams),
                     AMK_STAGES, AMK_STAGE_BYTES, AMK_TMA, AMK_PRELOAD, AMK_DTYPES,
                     AMK_ATTN_STAGES, AMK_ATTN_STAGE_BYTES, AMK_KV_REGION, AMK_TRACE_WORDS};
  for (int i = 0; i < n && i < 14; ++i) out[i] = v[i];
  return 14;
}

extern "C" const char* amk_error_string(int err) {
  if (err == AMK_LAUNCH_ERR_REG_POOL)
    return "AMK_RING_WG build: the kernel's launch register count differs from AMK_RING_WG_LAUNCH_REGS, so its "
           "setmaxnreg.inc could wait forever; not launched (rebuild without -DAMK_RING_WG)";
  return cudaGetErrorString((cudaError_t)err);
}
