// The torch extension (pybind) around the torch-free megakernel.cu: launch on the current torch stream,
// occupancy, build info, and the compiled struct layout (sizeof/offsetof of every AmkInstr / AmkBufDesc field,
// from the generated AMK_LAYOUT_ENTRIES table) that vm/loader.py compares with vm/abi.py before any launch.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <string>
#include <vector>

#include "amk_launch.h"

namespace {

void check_tensor(const torch::Tensor& t, const char* name, c10::ScalarType dtype, const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda(), "amk launch: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == dev, "amk launch: ", name, " is on ", t.device(), ", expected ", dev);
  TORCH_CHECK(t.is_contiguous(), "amk launch: ", name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, "amk launch: ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

// instrs: uint8 [n_instrs * sizeof(AmkInstr)]; queue_offsets: int32 [n_queues+1]; queue_items: int32 [n_tasks];
// bufs: uint8 [n_bufs * sizeof(AmkBufDesc)]; sync: int32 [status_offset + AMK_STATUS_LEN] = counters | status;
// trace_ptr: 0 or the address of an int64 CUDA tensor [n_instrs * AMK_TRACE_WORDS] (per-task timestamps).
void launch(const torch::Tensor& instrs, const torch::Tensor& queue_offsets, const torch::Tensor& queue_items,
            const torch::Tensor& bufs, const torch::Tensor& sync, int64_t n_counters, int64_t status_offset,
            int64_t grid, int64_t smem_bytes, int64_t timeout_ns, int64_t prefetch_cap, int64_t trace_ptr,
            int64_t wait_prefetch_bytes, int64_t preload_bytes, int64_t wait_prefetch_next_bytes,
            int64_t wait_prefetch_pace_bytes, const std::vector<int64_t>& io) {
  const torch::Device dev = instrs.device();
  check_tensor(instrs, "instrs", torch::kUInt8, dev);
  check_tensor(queue_offsets, "queue_offsets", torch::kInt32, dev);
  check_tensor(queue_items, "queue_items", torch::kInt32, dev);
  check_tensor(bufs, "bufs", torch::kUInt8, dev);
  check_tensor(sync, "sync", torch::kInt32, dev);
  TORCH_CHECK(instrs.numel() % (int64_t)sizeof(AmkInstr) == 0, "amk launch: instrs byte size is not a multiple of ",
              sizeof(AmkInstr));
  TORCH_CHECK(bufs.numel() % (int64_t)sizeof(AmkBufDesc) == 0, "amk launch: bufs byte size is not a multiple of ",
              sizeof(AmkBufDesc));
  TORCH_CHECK(queue_offsets.numel() == grid + 1, "amk launch: queue_offsets has ", queue_offsets.numel(),
              " entries for a grid of ", grid);
  TORCH_CHECK(status_offset >= n_counters && sync.numel() >= status_offset + AMK_STATUS_LEN,
              "amk launch: sync tensor too small");
  AmkParams p{};
  p.instrs = reinterpret_cast<const AmkInstr*>(instrs.data_ptr());
  p.queue_offsets = queue_offsets.data_ptr<int32_t>();
  p.queue_items = queue_items.data_ptr<int32_t>();
  p.bufs = reinterpret_cast<const AmkBufDesc*>(bufs.data_ptr());
  p.counters = sync.data_ptr<int32_t>();
  p.status = sync.data_ptr<int32_t>() + status_offset;
  p.timeout_ns = timeout_ns;
  p.prefetch_cap = prefetch_cap;
  TORCH_CHECK(wait_prefetch_bytes >= 0 && wait_prefetch_bytes <= (1 << 30), "amk launch: wait_prefetch_bytes ",
              wait_prefetch_bytes, " out of [0, 2^30]");
  p.wait_prefetch_bytes = (int32_t)wait_prefetch_bytes;
  TORCH_CHECK(wait_prefetch_next_bytes >= 0 && wait_prefetch_next_bytes <= (1 << 30),
              "amk launch: wait_prefetch_next_bytes ", wait_prefetch_next_bytes, " out of [0, 2^30]");
  p.wait_prefetch_next_bytes = (int32_t)wait_prefetch_next_bytes;
  TORCH_CHECK(wait_prefetch_pace_bytes >= 0 && wait_prefetch_pace_bytes <= (1 << 30) && wait_prefetch_pace_bytes % 16 == 0,
              "amk launch: wait_prefetch_pace_bytes ", wait_prefetch_pace_bytes, " must be a multiple of 16 in [0, 2^30]");
  p.wait_prefetch_pace_bytes = (int32_t)wait_prefetch_pace_bytes;
  TORCH_CHECK(preload_bytes >= 0 && preload_bytes % 128 == 0 && preload_bytes < smem_bytes,
              "amk launch: preload_bytes ", preload_bytes, " must be a multiple of 128 below smem_bytes ", smem_bytes);
  p.preload_bytes = (int32_t)preload_bytes;
  p.trace = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(trace_ptr));
  p.n_instrs = (int32_t)(instrs.numel() / (int64_t)sizeof(AmkInstr));
  p.n_bufs = (int32_t)(bufs.numel() / (int64_t)sizeof(AmkBufDesc));
  p.n_counters = (int32_t)n_counters;
  p.n_queues = (int32_t)grid;
  p.smem_bytes = (int32_t)smem_bytes;
  // io = {io_flags, in_token, in_pos, token, pos, next_token, out_token, n_steps} (addresses as integers, 0 = none;
  // pos, next_token and out_token hold n_steps words each)
  TORCH_CHECK(io.size() == 8, "amk launch: io must have 8 entries (flags, token id, position, 4 addresses, steps), "
              "got ", io.size());
  TORCH_CHECK(io[7] >= 1 && io[7] <= 64, "amk launch: steps per launch ", io[7], " out of [1, 64]");
  TORCH_CHECK(io[0] >= 0 && io[0] <= (AMK_IO_TOKEN | AMK_IO_POS | AMK_IO_ADVANCE), "amk launch: io flags ", io[0],
              " unknown");
  TORCH_CHECK(!(io[0] & AMK_IO_ADVANCE) || io[5] != 0, "amk launch: AMK_IO_ADVANCE needs the next_token address");
  TORCH_CHECK(io[0] == 0 || (io[3] != 0 && io[4] != 0), "amk launch: io flags need the token and pos addresses");
  TORCH_CHECK(io[1] >= INT32_MIN && io[1] <= INT32_MAX && io[2] >= INT32_MIN && io[2] <= INT32_MAX,
              "amk launch: token id / position out of int32 range");
  p.io_flags = (int32_t)io[0];
  p.in_token = (int32_t)io[1];
  p.in_pos = (int32_t)io[2];
  p.token = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(io[3]));
  p.pos = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(io[4]));
  p.next_token = reinterpret_cast<const int32_t*>(static_cast<uintptr_t>(io[5]));
  p.out_token = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(io[6]));
  p.n_steps = (int32_t)io[7];
  const c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev.index()).stream();
  const int err = amk_launch(&p, (int)grid, (int)smem_bytes, (void*)stream);
  TORCH_CHECK(err == 0, "amk megakernel launch failed (grid ", grid, ", smem ", smem_bytes,
              " B): ", amk_error_string(err));
}

void prepare(int64_t smem_bytes) {
  const int err = amk_prepare((int)smem_bytes);
  TORCH_CHECK(err == 0, "amk: cannot set dynamic shared memory to ", smem_bytes, " B: ", amk_error_string(err));
}

int64_t occupancy(int64_t smem_bytes) {
  int blocks = 0;
  const int err = amk_occupancy((int)smem_bytes, &blocks);
  TORCH_CHECK(err == 0, "amk occupancy query failed (smem ", smem_bytes, " B): ", amk_error_string(err));
  return blocks;
}

pybind11::dict layout() {
  const char* s[256];
  const char* f[256];
  long long v[256];
  const int n = amk_layout(s, f, v, 256);
  TORCH_CHECK(n <= 256, "amk layout table too long");
  pybind11::dict out;
  for (int i = 0; i < n; ++i) {
    const pybind11::str key(s[i]);
    if (!out.contains(key)) out[key] = pybind11::dict();
    pybind11::dict d = out[key].cast<pybind11::dict>();
    d[pybind11::str(f[i])] = v[i];
  }
  return out;
}

pybind11::dict build_info() {
  int v[14] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  amk_build_info(v, 14);
  pybind11::dict d;
  d["threads"] = v[0];
  d["prefetch_depth"] = v[1];
  d["abi_version"] = v[2];
  d["cudart_version"] = v[3];
  d["sizeof_params"] = v[4];
  d["ring_stages"] = v[5];
  d["stage_bytes"] = v[6];
  d["tma"] = v[7];
  d["ring_bytes"] = v[7] ? v[5] * v[6] : 0;
  d["preload"] = v[8];
  d["dtypes"] = v[9];
  d["attn_stages"] = v[10];
  d["attn_stage_bytes"] = v[11];
  d["kv_region"] = v[12];
  d["trace_words"] = v[13];  // (the kernel's: its build flags may add diagnostic marks)
  d["status_len"] = AMK_STATUS_LEN;
  d["status_abort_index"] = AMK_STATUS_ABORT;
  d["status_exits_index"] = AMK_STATUS_EXITS;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "AMK persistent megakernel VM (see vm/loader.py)";
  m.def("launch", &launch, "cooperative launch of the megakernel on the current stream");
  m.def("prepare", &prepare, "raise the kernel's dynamic shared memory limit");
  m.def("occupancy", &occupancy, "co-resident blocks per SM for a dynamic smem size");
  m.def("layout", &layout, "{struct: {field | 'sizeof': bytes}} as compiled");
  m.def("build_info", &build_info, "compile-time knobs of this build");
}
