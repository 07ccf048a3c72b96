"""Plain nvcc compiles the torch-free megakernel translation unit for sm_80 and sm_90a (skips without nvcc), with
the bulk-copy weight ring on (sm_90a path) and the register streaming path (sm_80). ptxas must report no warnings,
and the hot GEMV bodies (noinline, one per weight dtype) must not spill beyond saving a few callee-saved registers."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

from scripts.sass_loops import find_cuobjdump, ring_loops

CSRC = pathlib.Path(__file__).resolve().parents[2] / "vm" / "csrc"
# torch's extension build passes these; the .cu must compile under them too.
TORCH_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                 "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def spills(stderr: str) -> dict[str, int]:
    """{function: spill store bytes} from ptxas -v output (last entry per name wins: one arch at a time)."""
    out = {}
    for name, st in re.findall(r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores",
                               stderr):
        out[name] = max(out.get(name, 0), int(st))
    return out


# The preload build also carries the per-opcode no-wait diagnostic (sync.cuh AMK_DBG_NOWAIT_OPS: attention and
# merge tasks skip their waits), the run-twice one (megakernel.cu AMK_DBG_TWICE_OPS, with AMK_DBG_TWICE_NOKV) and
# the attention stage marks (AMK_DBG_ATTN_STAGE_MARKS), the GEMV setup mark (AMK_DBG_SETUP_MARK), the QKV tiles
# without their weight stream (AMK_DBG_QKV_NOSTREAM) and the down tiles' split-K QKV cost (AMK_DBG_SPLITK_QKV, its
# L2-prefetch mode 3; the ring build has its reduce-only mode 2), so the
# diagnostic
# switches scripts/ab_builds.py `diag:` variants use keep compiling; the ring build has the 4-split merge body only
# (the loader's choice for 4 splits) and the A/B switches' other sides (the tensor-core body called from
# amk_attn_core; the one-pass tile loop compiled but off; a code-layout pad, scripts/ab_builds.py --pads; the
# attention output written by the op after the body; the trace marks with the producer's and the per-warp ring
# stamps, AMK_DBG_RING_STAMPS); the preload build also has the task loop's old wait
# (AMK_JOIN_OPS=0), the default build's task loop keeps its spill stores small; so does the kv_ahead build's
# (early_kv 2: the attention stages at the top of shared memory, filled by the task before). The ring and kv_ahead
# builds also compile the data-flagged activations' code (AMK_FLAGS, flag_hops); the kv_ahead build the task loop with
# the next instruction copied ahead (AMK_INSTR_AHEAD).
@pytest.mark.parametrize("threads,depth,path", [(480, 2, ("-DAMK_TMA=1", "-DAMK_MERGE_UNROLL=4", "-DAMK_ATTN_FAST=0",
                                                          "-DAMK_ATTN_ONESHOT=2", "-DAMK_LAYOUT_PAD=4",
                                                          "-DAMK_ATTN_DIRECT=0", "-DAMK_MARKS=1",
                                                          "-DAMK_DBG_RING_STAMPS=1", "-DAMK_FLAGS=1",
                                                          "-DAMK_DBG_SPLITK_QKV=1", "-DAMK_DBG_SPLITK_MODE=2")),
                                                (512, 0, ("-DAMK_PRELOAD=1", "-DAMK_DBG_NOWAIT_OPS=384",
                                                          "-DAMK_DBG_TWICE_OPS=440", "-DAMK_DBG_TWICE_NOKV=1",
                                                          "-DAMK_MARKS=1", "-DAMK_DBG_ATTN_STAGE_MARKS=1",
                                                          "-DAMK_DBG_SETUP_MARK=1", "-DAMK_JOIN_OPS=0",
                                                          "-DAMK_DBG_QKV_NOSTREAM=1", "-DAMK_DBG_SPLITK_QKV=1",
                                                          "-DAMK_DBG_SPLITK_MODE=3")),
                                                (512, 0, ()),
                                                (512, 0, ("-DAMK_KV_AHEAD=1", "-DAMK_ATTN_EARLY=1", "-DAMK_FLAGS=1",
                                                          "-DAMK_INSTR_AHEAD=1"))],
                         ids=["ring", "preload", "default", "kv_ahead"])
def test_nvcc_compiles_sm80_sm90a(tmp_path, threads, depth, path):
    cmd = ["nvcc", "-std=c++17", "-O3", "-c", str(CSRC / "megakernel.cu"), "-o", str(tmp_path / "mk.o"),
           f"-I{CSRC}", "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
           f"-DAMK_THREADS={threads}", f"-DAMK_PREFETCH_DEPTH={depth}", *path, "-Xptxas=-v",
           *TORCH_DEFINES]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    warnings = [l for l in r.stderr.splitlines() if "warning" in l.lower()]
    assert not warnings, "\n".join(warnings)
    sp = spills(r.stderr)
    hot = {k: v for k, v in sp.items() if re.search(r"gemv_body|silu_body|silu_down_body|qkv_gemv_body", k)}
    assert len(hot) == 12, sorted(sp)   # 4 bodies x 3 weight dtypes
    assert all(v <= 32 for v in hot.values()), hot
    if not path or "-DAMK_KV_AHEAD=1" in path:   # the task loop runs per task: its spills are a per-task cost
                                                 # (docs/PERF.md, thirty-fourth session)
        assert sp["amk_megakernel"] <= 80, sp["amk_megakernel"]


@pytest.mark.parametrize("micro", ["ring_micro.cu", "hop_micro.cu", "mem_micro.cu", "l2_reuse_micro.cu", "gpc_probe.cu",
                                   "l2_home_micro.cu", "pipe_micro.cu"])
def test_microbenchmarks_compile(tmp_path, micro):
    """scripts/ring_micro.cu (bulk-copy vs register streaming), scripts/hop_micro.cu (the cost of one dependent
    hop, counter vs data-flag protocol, under background traffic), scripts/mem_micro.cu (per-SM rates of the
    register, L2, bulk-copy and cp.async paths) and scripts/l2_reuse_micro.cu (a gate/up tile after its rows were
    fetched into L2 by prefetch instructions, loads or bulk copies), scripts/gpc_probe.cu (which SMs share a
    GPC), scripts/l2_home_micro.cu (which L2 partition an SM and an address sit next to) and scripts/pipe_micro.cu
    (a decode step's weight stream with its hops, register path vs a windowed bulk-copy pipeline): the
    microbenchmarks and probes of docs/PERF.md still build."""
    src = pathlib.Path(__file__).resolve().parents[2] / "scripts" / micro
    r = subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-c", str(src), "-o", str(tmp_path / "m.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-4000:]


@pytest.mark.skipif(find_cuobjdump() is None,
                    reason="cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_ring_item_loops_keep_context_in_registers(tmp_path):
    """The weight ring's work-item loops (one per streamed GEMV body) re-read no context field and reload few spills
    per item: a local load that misses the L1 is an L2 round trip per 4 KB item (docs/PERF.md, forty-sixth session:
    7-8 per item before the ring state was held in registers and the shared-memory dot product unrolled less, 3-4
    after). The default ring geometry of the A/Bs (8 x 16 KB, 512 compute threads + the producer: 96 registers)."""
    exe = find_cuobjdump()
    obj = tmp_path / "ring.o"
    cmd = ["nvcc", "-std=c++17", "-O3", "-c", str(CSRC / "megakernel.cu"), "-o", str(obj), f"-I{CSRC}",
           "-gencode=arch=compute_90a,code=sm_90a", "-DAMK_THREADS=512", "-DAMK_PREFETCH_DEPTH=0", "-DAMK_TMA=1",
           "-DAMK_STAGES=8", "-DAMK_STAGE_BYTES=16384", "-DAMK_RING_WINDOW=2", "-DAMK_DTYPES=2",
           "-DAMK_MERGE_UNROLL=4", *TORCH_DEFINES]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    loops = ring_loops(str(obj), ["amk_gemv_body", "amk_silu_body", "amk_qkv_gemv_body"], exe)
    for name, ls in loops.items():
        assert ls, f"{name}: no ring item loop found"
        assert all(l["ldl"] <= 4 and l["stl"] == 0 for l in ls), (name, ls)


def test_setmaxnreg_lifts_the_callee_register_cap(tmp_path):
    """scripts/setmaxnreg_probe.cu: in a 640-thread block (96 registers at launch) a __noinline__ body that needs
    more than 96 registers spills without setmaxnreg and not with it (the producer warpgroup down to 24, the compute
    warpgroups up to 112, what the block's pool allows): ptxas allocates the code after setmaxnreg.inc, callees
    included, with the raised limit -- what a warpgroup-aligned weight-ring producer would give the megakernel's op
    bodies (docs/PERF.md, fifty-first session)."""
    src = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "setmaxnreg_probe.cu"
    body = {}
    for smr in (0, 1):
        r = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v", "-c",
                            str(src), "-o", str(tmp_path / f"p{smr}.o"), f"-DAMK_SMR={smr}"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        sp = spills(r.stderr)
        body[smr] = next(v for k, v in sp.items() if "probe_body" in k)
    assert body[0] > 0, body   # the 96-register cap spills
    assert body[1] == 0, body  # 120 registers after setmaxnreg.inc


def test_ring_wg_build_gives_its_ops_more_registers(tmp_path):
    """-DAMK_RING_WG=1 (vm/csrc/common.cuh): the weight ring's producer as a whole warpgroup that hands registers to
    the compute warps. ptxas must honour both setmaxnreg (no C7507 / C7508 'setmaxnreg ignored': one noinline
    function called from two register regions is enough to lose them, hence amk_exit's and amk_mbar_wait_for's
    per-region copies), the kernel must launch at the 96 registers the pool arithmetic assumes (the host refuses
    otherwise), and the hot op bodies must spill less than in the 17-warp ring build (96 registers throughout)."""
    def build(wg: int) -> tuple[str, pathlib.Path]:
        obj = tmp_path / f"wg{wg}.o"
        cmd = ["nvcc", "-std=c++17", "-O3", "-c", str(CSRC / "megakernel.cu"), "-o", str(obj), f"-I{CSRC}",
               "-gencode=arch=compute_90a,code=sm_90a", "-DAMK_THREADS=512", "-DAMK_PREFETCH_DEPTH=2", "-DAMK_TMA=1",
               "-DAMK_STAGES=8", "-DAMK_STAGE_BYTES=16384", "-DAMK_RING_WINDOW=2", "-DAMK_DTYPES=2",
               "-DAMK_MERGE_UNROLL=4", f"-DAMK_RING_WG={wg}", "-Xptxas=-v", *TORCH_DEFINES]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        return r.stderr, obj
    (base, _), (wg, obj) = build(0), build(1)
    assert "setmaxnreg" not in wg and "C750" not in wg, [l for l in wg.splitlines() if "C75" in l]
    launch = re.search(r"Compiling entry function 'amk_megakernel'.*?Used (\d+) registers", wg, re.S)
    assert launch and int(launch.group(1)) == 96, launch and launch.group(1)
    hot = re.compile(r"gemv_body|silu_body|qkv_gemv_body|attn_mma|amk_op_attn")
    spill = [sum(v for k, v in spills(t).items() if hot.search(k)) for t in (base, wg)]
    assert spill[1] <= 0.6 * spill[0], spill
    exe = find_cuobjdump()
    if exe:
        sass = subprocess.run([exe, "-sass", str(obj)], capture_output=True, text=True).stdout
        assert sass.count("USETMAXREG") == 2, sass.count("USETMAXREG")
