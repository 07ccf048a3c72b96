// The kernel's argument struct and the host entry points of megakernel.cu (plain C: no CUDA, no torch headers),
// shared by megakernel.cu (which defines them) and binding.cpp (the torch extension that calls them).
#pragma once
#include <stdint.h>
#include "amk_abi.h"

// Index of the abort flag inside the int32 status array (after the AMK_STATUS_WORDS report words).
#define AMK_STATUS_ABORT AMK_STATUS_WORDS
// Index of the exit count: blocks that have finished this launch (the last one resets the counters, megakernel.cu
// amk_exit; back to 0 between launches).
#define AMK_STATUS_EXITS (AMK_STATUS_WORDS + 1)
// Index of the launch epoch: launches completed since the sync array was last cleared (the last block out adds one,
// megakernel.cu amk_exit). The launch's tag of data-flagged activations is epoch + 1 (sync.cuh, knob flag_hops).
#define AMK_STATUS_EPOCH (AMK_STATUS_WORDS + 2)
// Length of the status array the host allocates (report words + abort flag + exit count + epoch).
#define AMK_STATUS_LEN 8

// AmkParams.io_flags: what this launch takes from its params instead of the IO buffers, and what its last block
// writes back (the step's input / output bookkeeping, done in the kernel so a step is one launch).
#define AMK_IO_TOKEN 1    // in_token is this launch's first token id (also stored into *token at exit)
#define AMK_IO_POS 2      // in_pos is this launch's first position (pos[s] = in_pos + s also stored at exit; with
                          // n_steps > 1 the steps' positions pos[1..] must already be in memory)
#define AMK_IO_ADVANCE 4  // at exit: *token = next_token[n_steps-1], pos[s] = position + n_steps + s (greedy
                          // decode on the device)

typedef struct AmkParams {
  const AmkInstr* instrs;        // [n_instrs] instruction PODs (index = task position in program.tasks)
  const int32_t* queue_offsets;  // [n_queues + 1] CSR offsets into queue_items
  const int32_t* queue_items;    // [n_tasks] instruction indices, per queue in run order
  const AmkBufDesc* bufs;        // [n_bufs] buffer descriptors
  int32_t* counters;             // [n_counters] monotonic counters: 0 at launch, reset by the launch's last block
  int32_t* status;               // [AMK_STATUS_LEN] error report words + abort flag
  uint64_t* trace;               // nullable: [n_instrs][AMK_TRACE_WORDS] %globaltimer ns stamps (below)
  int64_t timeout_ns;            // wait budget per wait (%globaltimer ns)
  int64_t prefetch_cap;          // L2 prefetch bytes per look-ahead task (0 = none)
  int32_t n_instrs, n_bufs, n_counters, n_queues;
  int32_t smem_bytes;            // dynamic shared memory of this launch (ring + preload + op area; ops check)
  int32_t wait_prefetch_bytes;   // L2 prefetch of a task's own weights when it must wait (0 = off; knob
                                 // wait_prefetch_kb)
  int32_t preload_bytes;         // size of the preload buffer (preload.cuh; 0 = off; knob preload_kb), 128-multiple
  int32_t wait_prefetch_next_bytes;  // while a task waits, also ask L2 for this many bytes of the NEXT queued
                                     // task's weights, after its own (0 = off; knob wait_prefetch_next_kb)
  int32_t wait_prefetch_pace_bytes;  // bytes of those prefetches issued per poll of the wait (0 = all at once, on
                                     // the first poll; knob wait_prefetch_pace_kb)
  int32_t io_flags;              // AMK_IO_* above
  int32_t in_token, in_pos;      // this step's token id / position where io_flags says so
  int32_t n_steps;               // decode steps per launch (steps_per_launch): 'pos@s' is pos[s], 'next_token@s'
                                 // next_token[s]
  int32_t* token;                // first word of the IO buffers 'token' and 'pos' (nullable: no IO bookkeeping)
  int32_t* pos;                  // [n_steps] the launch's positions: pos[s] = pos[0] + s
  const int32_t* next_token;     // [n_steps] each step's next token (nullable)
  int32_t* out_token;            // nullable: with AMK_IO_ADVANCE, next_token[0..n_steps) is also stored here
                                 // (decode history)
} AmkParams;

// Trace record words per instruction (see AmkParams.trace): wait begin, ready, end, SM, then AMK_TRACE_MARKS
// optional marks inside the task (0 = not reached; only in builds with -DAMK_MARKS=1): op entry (after the wait barrier), input staged (x / q in
// shared memory), main loop done (thread 0's share), closing barrier passed (before the counter signal); then, set by
// the weight ring's producer in ring builds (stream.cuh), the task's first stage issued and its last stage issued.
// AMK_DBG_RING_STAMPS 1 (diagnostic, with AMK_MARKS and the ring): 64 more marks, per compute warp w of a streamed
// task: 6 + w its work items done, 38 + w its first stage wait over (ops_gemv.cuh amk_gemv_streamed).
#ifndef AMK_DBG_RING_STAMPS
#define AMK_DBG_RING_STAMPS 0
#endif
#define AMK_TRACE_MARKS (6 + (AMK_DBG_RING_STAMPS ? 64 : 0))
#define AMK_TRACE_WORDS (4 + AMK_TRACE_MARKS)

#ifdef __cplusplus
extern "C" {
#endif
// All return a cudaError_t value (0 = success).
int amk_prepare(int smem_bytes);                                   // raise the dynamic smem limit (once per size)
int amk_launch(const AmkParams* p, int grid, int smem_bytes, void* stream);  // cooperative launch on `stream`
int amk_occupancy(int smem_bytes, int* blocks_per_sm);             // co-resident blocks per SM
int amk_layout(const char** structs, const char** fields, long long* values, int max_entries);  // -> count
int amk_build_info(int* out, int n);  // threads, prefetch depth, ABI version, CUDART, sizeof params, ring
                                      // stages, stage bytes, tma, preload, dtypes, attention stages, bytes, KV region,
                                      // trace words
const char* amk_error_string(int err);
#ifdef __cplusplus
}
#endif
