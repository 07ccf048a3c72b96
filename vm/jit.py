"""JIT build of the megakernel extension (torch.utils.cpp_extension + ninja), cached forever by content hash.

A ``BuildSpec`` names the sources (``vm/csrc/binding.cpp`` + the torch-free ``megakernel.cu``), the build knobs
(``-DAMK_THREADS``, ``-DAMK_PREFETCH_DEPTH``; the sm_90+ shared-memory weight ring ``-DAMK_TMA/-DAMK_STAGES/
-DAMK_STAGE_BYTES``, opt-in with ``AMK_TMA=1`` or ``tma=True``) and the gencode of the live device (sm_80, sm_89,
sm_90a, sm_100a, ...). Its digest hashes every file in ``vm/csrc`` + flags + arch + torch / CUDA / Python versions,
and names the module ``amk_mk_<digest>`` in ``$AMK_CACHE_DIR`` (default ``~/.cache/amk``). Reuse needs the metadata
sidecar (``amk_build.json``) to match the digest; builds run under an ``fcntl`` lock, so concurrent processes build
once and a second process imports the cached ``.so`` directly (no ninja, no nvcc). Measured on an H100: build 24-36 s,
reload in a second process < 0.01 s. The loader's specs hold only the code their program reaches (``ops``,
``attn_hds``, ``qk_fold``, ``group_early``: vm/pack.py ``build_trims``); ``AMK_NO_TRIM=1`` asks for full builds.

    mod = get_megakernel(threads=512, prefetch_depth=2)   # build or load, then cached in-process
    preload(program.config)                               # build ahead (e.g. while lowering)
    LAST_BUILD                                            # {"name", "built", "build_s", "load_s", "so"}
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import time
from typing import Any

from vm.abi import DTYPE_CODES, OPCODES

CSRC = pathlib.Path(__file__).resolve().parent / "csrc"
SOURCES = ("binding.cpp", "megakernel.cu")
MERGE_UNROLLS = (0, 4, 8, 16)   # AMK_MERGE_UNROLL values (vm/csrc/attn_common.cuh)
ALL_DTYPES = (1 << DTYPE_CODES["f32"]) | (1 << DTYPE_CODES["bf16"]) | (1 << DTYPE_CODES["f16"])   # AMK_DTYPES
ALL_OPS = sum(1 << op.code for op in OPCODES.values())   # AMK_OPS_MASK: every opcode
ALL_ATTN_HDS = 3   # AMK_ATTN_HD64 | AMK_ATTN_HD128 << 1
META_NAME = "amk_build.json"
_LOADED: dict[str, Any] = {}
LAST_BUILD: dict[str, Any] = {}
BUILDS: dict[str, dict[str, Any]] = {}   # name -> stats of every build/load in this process


class BuildError(RuntimeError):
    """The extension could not be built or loaded (the message carries the compiler output where there is one)."""


def device_arch(index: int = 0) -> str:
    """nvcc target of the live device: sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120, ..."""
    import torch
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device: cannot pick a gencode (pass arch='sm_90a' etc. explicitly)")
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}" + ("a" if (major, minor) in ((9, 0), (10, 0)) else "")


def gencode_flag(arch: str) -> str:
    """'sm_90a' -> '-gencode=arch=compute_90a,code=sm_90a'."""
    if not arch.startswith("sm_"):
        raise BuildError(f"bad arch {arch!r} (expected e.g. 'sm_90a')")
    num = arch[3:]
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def cache_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("AMK_CACHE_DIR") or (pathlib.Path.home() / ".cache" / "amk"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclasses.dataclass(frozen=True)
class BuildSpec:
    """What to compile and how. Every field changes the digest, hence the module name."""
    threads: int = 512
    prefetch_depth: int = 2
    arch: str = "sm_90a"
    tma: bool = True              # weight ring with bulk copies (sm_90+ only)
    stages: int = 4               # ring stages
    stage_bytes: int = 32768      # bytes per ring stage
    ring_window: int = 2          # ring copies in flight at most (issued, not landed; < stages)
    opt: str = "-O3"
    extra_cuda_cflags: tuple[str, ...] = ()
    preload: bool = False         # whole-tile weight preload path (sm_90+, vm/csrc/preload.cuh)
    dtypes: int = ALL_DTYPES      # element types compiled in: bit (1 << DTYPE_CODES[name]) per weight / cache type
    attn_stages: int = 2          # attention KV tiles in flight (cp.async into shared memory, ops_attention.cuh)
    attn_stage_bytes: int = 32768  # bytes per attention stage (K + V rows of one tile)
    merge_unroll: int = 16        # ATTN_MERGE's unrolled bodies: 4 / 8 / 16 splits and below (0 = the loop only;
                                  # the loader picks the smallest covering the program, vm/csrc/attn_common.cuh)
    attn_early: bool = False      # the KV copies before the wait for early_kv-hinted attention tasks (compiled in
                                  # only for programs with hints: unused, the path cost 2% at ctx 32768 on an H100)
    kv_ahead: bool = False        # early_kv 2: the attention stages at the top of shared memory, filled by the task
                                  # before (amk_kv_ahead; the loader asks for it when the program has such tasks)
    flags: bool = False           # data-flagged activations' polls and stores (flag_hops, vm/csrc/sync.cuh; the
                                  # loader asks for it when the program has flagged buffers, else compiled out)
    ops: int = ALL_OPS            # opcodes compiled in: bit (1 << opcode) each (AMK_OPS_MASK); the loader passes the
                                  # program's own (build_trims), the others then fail as unknown opcodes
    attn_hds: int = ALL_ATTN_HDS  # head dims of the tensor-core attention body: bit 0 = 64, bit 1 = 128
    qk_fold: bool = True          # the attention tasks' folded QK-norm (fold_qk_norm programs)
    group_early: bool = True      # the o_proj-by-group GEMV body (x_splits with accumulate: o_proj_by_group)


    def __post_init__(self):
        if not (128 <= self.threads <= 1024 and self.threads % 32 == 0):
            raise BuildError(f"threads_per_block {self.threads}: must be a multiple of 32 in [128, 1024]")
        if not 0 <= self.prefetch_depth <= 8:
            raise BuildError(f"prefetch_depth {self.prefetch_depth}: must be in [0, 8]")
        if self.tma and arch_major(self.arch) < 9:
            raise BuildError(f"the bulk-copy weight ring needs sm_90+, not {self.arch} (tma=False)")
        if not (self.dtypes & ALL_DTYPES) or self.dtypes & ~ALL_DTYPES:
            raise BuildError(f"dtypes mask {self.dtypes}: a non-empty subset of {ALL_DTYPES} (f32, bf16, f16 bits)")
        if not (1 <= self.stages <= 32 and self.stage_bytes % 128 == 0 and 4096 <= self.stage_bytes <= 65536):
            raise BuildError(f"ring geometry {self.stages} x {self.stage_bytes} B out of range")
        if self.tma and not 1 <= self.ring_window < max(self.stages, 2):
            raise BuildError(f"ring_window {self.ring_window}: 1 .. stages - 1 ({self.stages} stages) copies in flight")
        if not (1 <= self.attn_stages <= 4 and self.attn_stage_bytes % 16 == 0
                and 4096 <= self.attn_stage_bytes <= 65536):
            raise BuildError(f"attention stages {self.attn_stages} x {self.attn_stage_bytes} B: 1..4 stages of "
                             f"4096..65536 B (a multiple of 16)")
        if self.merge_unroll not in MERGE_UNROLLS:
            raise BuildError(f"merge_unroll {self.merge_unroll}: one of {MERGE_UNROLLS}")
        if self.ops & ~ALL_OPS or self.attn_hds & ~ALL_ATTN_HDS:
            raise BuildError(f"ops mask {self.ops:#x} / attention head-dim mask {self.attn_hds}: subsets of "
                             f"{ALL_OPS:#x} (vm.abi.OPCODES) / {ALL_ATTN_HDS} (64, 128)")

    @property
    def sources(self) -> list[str]:
        return [str(CSRC / s) for s in SOURCES]

    def cuda_cflags(self) -> list[str]:
        base = [self.opt, "-lineinfo", gencode_flag(self.arch), f"-DAMK_THREADS={self.threads}",
                f"-DAMK_PREFETCH_DEPTH={self.prefetch_depth}", f"-DAMK_TMA={int(self.tma)}",
                f"-DAMK_STAGES={self.stages}", f"-DAMK_STAGE_BYTES={self.stage_bytes}",
                f"-DAMK_RING_WINDOW={self.ring_window}",
                f"-DAMK_PRELOAD={int(self.preload)}", f"-DAMK_DTYPES={self.dtypes}",
                f"-DAMK_ATTN_STAGES={self.attn_stages}", f"-DAMK_ATTN_STAGE_BYTES={self.attn_stage_bytes}",
                f"-DAMK_ATTN_EARLY={int(self.attn_early or self.kv_ahead)}", f"-DAMK_KV_AHEAD={int(self.kv_ahead)}",
                f"-DAMK_FLAGS={int(self.flags)}", f"-DAMK_MERGE_UNROLL={self.merge_unroll}"]
        if (self.ops, self.attn_hds, self.qk_fold, self.group_early) != (ALL_OPS, ALL_ATTN_HDS, True, True):
            base += [f"-DAMK_OPS_MASK={self.ops:#x}u", f"-DAMK_ATTN_HD64={self.attn_hds & 1}",
                     f"-DAMK_ATTN_HD128={self.attn_hds >> 1 & 1}", f"-DAMK_QK_FOLD={int(self.qk_fold)}",
                     f"-DAMK_GROUP_EARLY={int(self.group_early)}"]
        own = {f.split("=")[0] for f in self.extra_cuda_cflags if f.startswith("-D")}   # an A/B's own defines win
        return [f for f in base if not (f.startswith("-D") and f.split("=")[0] in own)] + list(self.extra_cuda_cflags)

    def cflags(self) -> list[str]:
        return [self.opt]

    def digest(self) -> str:
        import torch
        h = hashlib.sha256()
        for f in sorted(CSRC.iterdir()):
            if f.suffix in (".cu", ".cuh", ".h", ".cpp") and f.name != "layout_probe.cpp":
                h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        h.update(json.dumps({"cuda": self.cuda_cflags(), "c": self.cflags(), "arch": self.arch,
                             "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                             "python": sys.version.split()[0]}, sort_keys=True).encode())
        return h.hexdigest()

    def name(self, digest: str | None = None) -> str:
        return f"amk_mk_{(digest or self.digest())[:16]}"


def arch_major(arch: str) -> int:
    digits = "".join(ch for ch in arch[3:] if ch.isdigit())
    return int(digits[:-1]) if len(digits) >= 2 else 0


def spec_for(threads: int = 512, prefetch_depth: int = 2, arch: str | None = None, tma: bool | None = None,
             stages: int | None = None, stage_bytes: int | None = None, preload: bool = False,
             dtypes: int = 0, attn_early: bool = False, merge_unroll: int = 16, kv_ahead: bool = False,
             ring_window: int | None = None, flags: bool = False, ops: int = 0, attn_hds: int | None = None,
             qk_fold: bool = True, group_early: bool = True) -> BuildSpec:
    """The spec for these knobs on ``arch`` (default: the live device). tma/stages/stage_bytes default from the
    environment (AMK_TMA=1 turns the sm_90+ weight ring on; AMK_STAGES, AMK_STAGE_BYTES: 4 x 32 KB; AMK_RING_WINDOW:
    the ring's copies in flight, 2, at most one less than the stages; ``ring_window`` overrides it); extra nvcc
    flags (e.g. -DAMK_U1=16 -DAMK_U2=8) from AMK_NVCC_FLAGS. The ring is off by default: on H100 the register
    streaming path measured faster (docs in vm/csrc/stream.cuh). ``dtypes``: the weight / KV-cache element types to
    compile (a mask, see ``dtype_mask``; 0 = all): one type per build is ~half the SASS, and measured ~1% faster on
    llama-3.2-1b (docs/PERF.md, fourth session). The attention KV pipeline defaults from AMK_ATTN_STAGES and
    AMK_ATTN_STAGE_BYTES (2 x 32 KB). ``attn_early``: compile the early KV copies of early_kv-hinted attention tasks
    (the loader asks for it when the program has hints). ``merge_unroll``: ATTN_MERGE's largest unrolled body (4, 8,
    16; 0 = none; the loader passes the smallest that covers the program's splits: merge_unroll_for). ``kv_ahead``:
    the attention stages at the top of shared memory, filled by the task before an early_kv 2 attention task.
    ``flags``: the data-flagged activations' code (programs lowered with flag_hops). ``ops`` (0 = all),
    ``attn_hds`` (None = both), ``qk_fold``, ``group_early``: the code a program's tasks can reach (vm.pack
    build_trims); the defaults compile everything."""
    arch = arch or device_arch()
    if tma is None:
        tma = arch_major(arch) >= 9 and os.environ.get("AMK_TMA", "0") != "0"
    tma = bool(tma) and arch_major(arch) >= 9
    stages = int(stages or os.environ.get("AMK_STAGES", 4))
    stage_bytes = int(stage_bytes or os.environ.get("AMK_STAGE_BYTES", 32768))
    if not ring_window:   # (None or 0: the environment's, else 2 -- 1 with 2 stages)
        ring_window = int(os.environ.get("AMK_RING_WINDOW", min(2, max(stages - 1, 1))))
    extra = tuple(os.environ.get("AMK_NVCC_FLAGS", "").split())
    preload = bool(preload) and arch_major(arch) >= 9 and not tma   # the preload and the ring exclude each other
    return BuildSpec(int(threads), int(prefetch_depth), arch, tma, stages, stage_bytes, ring_window,
                     extra_cuda_cflags=extra,
                     preload=preload, dtypes=int(dtypes) or ALL_DTYPES,
                     attn_stages=int(os.environ.get("AMK_ATTN_STAGES", 2)),
                     attn_stage_bytes=int(os.environ.get("AMK_ATTN_STAGE_BYTES", 32768)),
                     attn_early=bool(attn_early), merge_unroll=int(merge_unroll), kv_ahead=bool(kv_ahead),
                     flags=bool(flags), ops=int(ops) or ALL_OPS,
                     attn_hds=ALL_ATTN_HDS if attn_hds is None else int(attn_hds), qk_fold=bool(qk_fold),
                     group_early=bool(group_early))


def dtype_mask(names) -> int:
    """Build mask of element-type names ('f32', 'bf16', 'f16'; others, e.g. 'i32', have no typed code path)."""
    return sum(1 << DTYPE_CODES[n] for n in set(names) if n in ("f32", "bf16", "f16"))


def _import_so(name: str, so: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, str(so))
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta_ok(meta_path: pathlib.Path, digest: str, so: pathlib.Path) -> bool:
    if not (meta_path.is_file() and so.is_file()):
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("digest") == digest and meta.get("so") == so.name


def build(spec: BuildSpec, verbose: bool | None = None):
    """Build (or reuse) the extension for ``spec``; returns the imported module."""
    import torch  # noqa: F401  (the extension links against libtorch: load it first)
    digest = spec.digest()
    name = spec.name(digest)
    if name in _LOADED:
        return _LOADED[name]
    verbose = bool(int(os.environ.get("AMK_JIT_VERBOSE", "0"))) if verbose is None else verbose
    root = cache_dir()
    bdir = root / name
    so = bdir / f"{name}.so"
    meta_path = bdir / META_NAME
    t0 = time.perf_counter()
    built = False
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _meta_ok(meta_path, digest, so):
                from torch.utils.cpp_extension import load
                bdir.mkdir(parents=True, exist_ok=True)
                # torch's own build baton: a build killed mid-way (a timeout) leaves this file, and every later
                # build of the same name then waits on it forever. Under our lock no other build of it can run.
                (bdir / "lock").unlink(missing_ok=True)
                try:
                    mod = load(name=name, sources=spec.sources, extra_cflags=spec.cflags(),
                               extra_cuda_cflags=spec.cuda_cflags(), extra_include_paths=[str(CSRC)],
                               build_directory=str(bdir), verbose=verbose, with_cuda=True)
                except Exception as e:  # compiler errors come as RuntimeError/CalledProcessError with the log
                    raise BuildError(f"building {name} ({spec.arch}, threads={spec.threads}, "
                                     f"prefetch_depth={spec.prefetch_depth}) failed:\n{e}") from e
                built = True
                build_s = time.perf_counter() - t0
                meta = {"digest": digest, "so": so.name, "arch": spec.arch, "threads": spec.threads,
                        "prefetch_depth": spec.prefetch_depth, "tma": spec.tma, "cuda_cflags": spec.cuda_cflags(),
                        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "build_s": round(build_s, 2),
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
                tmp = meta_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(meta, indent=1))
                tmp.replace(meta_path)
            else:
                mod = _import_so(name, so)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    dt = time.perf_counter() - t0
    stats = {"name": name, "built": built, "build_s": round(dt, 3) if built else 0.0,
             "load_s": 0.0 if built else round(dt, 3), "so": str(so), "arch": spec.arch,
             "threads": spec.threads, "prefetch_depth": spec.prefetch_depth, "tma": spec.tma,
             "stages": spec.stages, "stage_bytes": spec.stage_bytes}
    LAST_BUILD.clear()
    LAST_BUILD.update(stats)
    BUILDS[name] = stats
    _LOADED[name] = mod
    return mod


def get_megakernel(threads: int = 512, prefetch_depth: int = 2, arch: str | None = None, verbose: bool | None = None,
                   tma: bool | None = None, stages: int | None = None, stage_bytes: int | None = None):
    """The extension module for these build knobs (built once per content hash, then loaded from the cache)."""
    return build(spec_for(threads, prefetch_depth, arch, tma, stages, stage_bytes), verbose)


def knobs_from_config(config: Any) -> tuple[int, int]:
    """(threads_per_block, prefetch_depth) from a program.config dict or a ScheduleConfig (defaults: 512, 2)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return int(d.get("threads_per_block", 512)), int(d.get("prefetch_depth", 2))


def build_flags(config: Any, arch: str = "sm_90a") -> list[str]:
    """The nvcc flags of the build a config (dict or ScheduleConfig) asks for on ``arch`` from its build knobs
    (threads_per_block, prefetch_depth, the weight ring's ring_stages / ring_stage_kb / ring_window), before the
    program's own needs (dtypes, merge bodies, preload, ...) and the shared-memory fit that vm.pack.select_build
    adds. No GPU needed."""
    from vm.pack import ring_knobs
    ring = ring_knobs(config)
    return spec_for(*knobs_from_config(config), arch, bool(ring), **ring).cuda_cflags()


def preload(config: Any = None, arch: str | None = None, verbose: bool | None = None) -> dict:
    """Build ahead for a config (dict or ScheduleConfig); returns the build stats."""
    threads, depth = knobs_from_config(config)
    get_megakernel(threads, depth, arch, verbose)
    return dict(LAST_BUILD)


if __name__ == "__main__":  # python -m vm.jit [threads] [prefetch_depth]: build for the live device, print stats
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    d = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    get_megakernel(t, d, verbose=True)
    print(json.dumps(LAST_BUILD))
