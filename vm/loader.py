"""MegakernelVM: packs a MegakernelProgram into the POD tables of vm/abi.py, uploads it once, and runs one
cooperative persistent launch per decode step.

    vm = MegakernelVM(program, weights)                 # validate, JIT build, layout check, upload
    logits = vm.step(token, pos)                        # device fp32 [vocab] (live buffer: clone() to keep it)
    toks = vm.decode(first_token, start_pos, n_tokens)  # greedy, zero host syncs per token (one per chunk)
    out = vm.decode_device(n, first_token, start_pos)   # same on the device only (CUDA-graph replay if prepared)
    tr = vm.trace_step()                                # per-task %globaltimer stamps (wait begin, ready, end, SM)

Build knobs come from ``program.config`` (threads_per_block, prefetch_depth) and can be overridden; ``tma=True``
selects the sm_90 bulk-copy weight ring (vm/csrc/stream.cuh, opt-in), ``prefetch_fraction`` the L2 share of the
look-ahead prefetch window, ``preload_kb`` (default: the config's knob) the whole-tile weight preload buffer
(vm/csrc/preload.cuh, sm_90+ builds without the ring). Errors raised by a launch name the task, opcode, SM and,
for timeouts, the counter.

Device state (all allocated once): weights (tied ones share storage), KV caches zeroed in their dtype, CONST
tables from ``Buffer.data``, fp32 activations, the instruction / queue / buffer-descriptor tables, and one int32
``sync`` tensor = counters | status words. A step is ONE launch: int token / pos travel in the launch params, and
the kernel's last block resets the counters and stores the step's IO (greedy decode: token = next_token, pos += 1)
for the next launch (amk_exit in vm/csrc/megakernel.cu; a memset and two fills per step were ~7.7 us of stream gaps
on an H100, docs/PERF.md). An aborted launch leaves counters and status for the report; check_status() clears them.
The pure functions ``pack_instructions``, ``pack_buffers``, ``pack_queues`` and ``check_layout`` (and the shared-
memory layout in vm/smem.py) run on CPU (tests use them without a GPU).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from schedule.ir import BufferKind, DType, MegakernelProgram, find_weight
from schedule.ops import accesses, is_dyn, kv_ahead_issuer_ok, weight_ranges
from vm import abi
from vm.smem import STREAM_OPS, _pad4, attn_fold_fits, attn_keys, kv_region_bytes, smem_floats

KIND_CODES = {k: abi.KIND_CODES[k.value] for k in BufferKind}
STATUS_LEN = 8                 # AMK_STATUS_LEN: report words + abort flag + exit count
IO_TOKEN, IO_POS, IO_ADVANCE = 1, 2, 4   # AMK_IO_* (amk_launch.h): the launch's io_flags
STATIC_SMEM_RESERVE = 2048     # bytes of static shared memory of the kernel (704 B measured) + margin
DTYPE_DETAILS = {-200 - code: name for name, code in abi.DTYPE_CODES.items()}   # AMK_DTYPE_DETAIL - dtype (common.cuh)
PRELOAD_DETAIL = -100         # AMK_PRELOAD_DETAIL (vm/csrc/preload.cuh): TIMEOUT detail of the preload barrier
L2_PREFETCH_FRACTION = 0.5     # default share of L2 the look-ahead prefetch window may take (all blocks)


class MegakernelError(RuntimeError):
    """A program the GPU VM refuses or a launch that failed (the message names task, opcode, counter or field)."""


class AbiMismatchError(MegakernelError):
    """The built extension's struct layout differs from vm/abi.py."""


# ------------------------------------------------------------------------------------------------------------------
# Pure packing helpers (CPU)
# ------------------------------------------------------------------------------------------------------------------
def check_layout(reported: dict, expected: dict) -> None:
    """Raise AbiMismatchError naming struct and field if ``reported`` (extension) != ``expected`` (vm.abi)."""
    errs = []
    for sname, fields in expected.items():
        got = reported.get(sname)
        if got is None:
            errs.append(f"struct {sname} missing from the built extension")
            continue
        for f, v in fields.items():
            if f not in got:
                errs.append(f"{sname}.{f} missing from the built extension")
            elif int(got[f]) != int(v):
                what = "sizeof" if f == "sizeof" else "offset"
                errs.append(f"{sname}.{f}: {what} {int(got[f])} in the built extension, {int(v)} in vm/abi.py")
        for f in got:
            if f not in fields:
                errs.append(f"{sname}.{f} present in the built extension but not in vm/abi.py")
    for sname in reported:
        if sname not in expected:
            errs.append(f"struct {sname} present in the built extension but not in vm/abi.py")
    if errs:
        raise AbiMismatchError("ABI layout mismatch (regenerate vm/csrc/amk_abi.h with `python -m vm.abi` and "
                               "rebuild): " + "; ".join(errs))


def device_dtype(b) -> DType:
    """Storage dtype on the device: weights / KV / CONST keep theirs; activations and outputs are fp32 (ints stay)."""
    if b.kind in (BufferKind.WEIGHT, BufferKind.KV_CACHE, BufferKind.CONST):
        return b.dtype
    return DType.I32 if b.dtype == DType.I32 else DType.F32


def launch_knobs(config) -> dict[str, int]:
    """The launch parameters a ScheduleConfig (dict) sets on an already built kernel (knobs with affects='launch')."""
    from flywheel.prior import KNOB_BY_NAME
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    kb = int(d.get("wait_prefetch_kb", KNOB_BY_NAME["wait_prefetch_kb"].default))
    pk = int(d.get("preload_kb", KNOB_BY_NAME["preload_kb"].default))
    nk = int(d.get("wait_prefetch_next_kb", KNOB_BY_NAME["wait_prefetch_next_kb"].default))
    pace = int(d.get("wait_prefetch_pace_kb", KNOB_BY_NAME["wait_prefetch_pace_kb"].default))
    return {"wait_prefetch_bytes": kb * 1024, "preload_bytes": pk * 1024, "wait_prefetch_next_bytes": nk * 1024,
            "wait_prefetch_pace_bytes": pace * 1024}


def prefetch_cap_bytes(l2_bytes: int, grid: int, depth: int, fraction: float | None = None) -> int:
    """L2 prefetch bytes per look-ahead task: the window (depth tasks per block) fits in a share of L2
    (``fraction``, default $AMK_L2_PREFETCH_FRACTION or 0.5)."""
    if fraction is None:
        fraction = float(os.environ.get("AMK_L2_PREFETCH_FRACTION", L2_PREFETCH_FRACTION))
    if depth <= 0 or grid <= 0:
        return 0
    return int(l2_bytes * fraction / grid / depth) // 16 * 16


def pack_instructions(program: MegakernelProgram, buffer_ptr: Callable[[int], int] | None = None,
                      stage_bytes: int = 0, preload_cap: int = 0) -> np.ndarray:
    """One INSTR_DTYPE record per task (index = position in program.tasks). ``buffer_ptr(id)`` gives device
    addresses for the exact weight ranges (None: ranges left empty). ``stage_bytes`` > 0 (a build with the weight
    ring) sets INSTR_FLAG_STREAM on GEMV-family tasks whose rows are 16-byte multiples and fit a stage.
    ``preload_cap`` > 0 (sm_90+, no ring) sets INSTR_FLAG_PRELOAD on GEMV-family tasks whose whole weight tile
    (all ranges, 16-byte aligned, rows 16-byte multiples) fits that many bytes (vm/csrc/preload.cuh)."""
    bufs = program.buffers
    numel = lambda i: bufs[i].numel  # noqa: E731
    out = np.zeros(len(program.tasks), dtype=abi.INSTR_DTYPE)
    for i, t in enumerate(program.tasks):
        spec = abi.OPCODES.get(t.op)
        if spec is None:
            raise MegakernelError(f"task {t.id}: unknown opcode {t.op!r}")
        if len(t.waits) > abi.MAX_WAITS:
            raise MegakernelError(f"task {t.id} ({t.op}): {len(t.waits)} waits > MAX_WAITS {abi.MAX_WAITS}")
        slots = list(t.inputs) + list(t.outputs)
        if len(slots) > abi.MAX_BUFS:
            raise MegakernelError(f"task {t.id} ({t.op}): {len(slots)} buffers > MAX_BUFS {abi.MAX_BUFS}")
        r = out[i]
        r["op"], r["out_counter"], r["n_waits"], r["n_bufs"] = spec.code, t.out_counter, len(t.waits), len(slots)
        for k, w in enumerate(t.waits):
            r["wait_counter"][k], r["wait_threshold"][k] = w.counter, w.threshold
        r["buf"][:len(slots)] = slots
        r["ip"][:len(spec.iparams)] = [int(t.params.get(n, 0)) for n in spec.iparams]
        r["fp"][:len(spec.fparams)] = [float(t.params.get(n, 0.0)) for n in spec.fparams]
        r["task_id"] = t.id
        if buffer_ptr is None:
            continue
        ranges = [a for a in weight_ranges(t, numel) if a.slot != "table"][:abi.MAX_PREFETCH]
        for k, a in enumerate(ranges):
            es = bufs[a.buffer].dtype.nbytes
            r["prefetch_ptr"][k] = buffer_ptr(a.buffer) + a.lo * es
            r["prefetch_bytes"][k] = (a.hi - a.lo) * es
        nmat = STREAM_OPS.get(t.op, 0)
        if not (nmat and ranges) or is_dyn(t.params):   # (a claim-group member's rows are known at run time)
            continue
        row_bytes = int(t.params["k"]) * bufs[ranges[0].buffer].dtype.nbytes
        aligned = row_bytes % 16 == 0 and all(int(x) % 16 == 0 for x in r["prefetch_ptr"][:len(ranges)])
        if stage_bytes > 0 and len(ranges) == nmat and aligned and nmat * row_bytes <= stage_bytes:
            r["flags"] |= abi.INSTR_FLAG_STREAM
        elif preload_cap > 0 and aligned and int(r["prefetch_bytes"][:len(ranges)].sum()) <= preload_cap:
            r["flags"] |= abi.INSTR_FLAG_PRELOAD
    out["next_preload"] = -1
    index = {t.id: i for i, t in enumerate(program.tasks)}
    for q in program.queues:   # early_kv 2: the task before issues the KV history (vm/csrc: amk_kv_ahead)
        for j, tid in enumerate(q):
            t = program.tasks[index[tid]]
            if int(t.params.get("early_kv", 0)) == 2:
                prev = program.tasks[index[q[j - 1]]] if j > 0 else None
                if prev is None or not kv_ahead_issuer_ok(prev):
                    raise MegakernelError(f"task {t.id} ({t.op}): early_kv 2 needs a weight tile before it in its "
                                          f"queue that issues no cp.async of its own (schedule.ops."
                                          f"kv_ahead_issuer_ok), got {prev.op if prev else 'none'}")
                out[index[prev.id]]["flags"] |= abi.INSTR_FLAG_KV_AHEAD
    for q in program.queues:   # each flagged task but a queue's first: the task whose start issues its preload
        prev = -1
        for j, tid in enumerate(q):
            if out[index[tid]]["flags"] & abi.INSTR_FLAG_PRELOAD:
                if prev >= 0:
                    out[index[q[preload_issuer(prev, j)]]]["next_preload"] = index[tid]
                prev = j
    return out


def preload_issuer(prev: int, j: int) -> int:
    """Queue position whose task start issues the preload of the flagged task at position j, the previous flagged
    task being at position prev: the task just before j (so the copy lands while the HBM is otherwise idle, e.g.
    during attention, not during the MLP streaming before it), but never before prev is done with the buffer."""
    return max(prev + 1, j - 1)


def preload_buffer_bytes(instrs: np.ndarray) -> int:
    """Size of the preload buffer the flagged instructions need: their largest tile, rounded up to 128 bytes."""
    flagged = (instrs["flags"] & abi.INSTR_FLAG_PRELOAD) != 0
    if not flagged.any():
        return 0
    return int(-(-int(instrs["prefetch_bytes"][flagged].sum(axis=1).max()) // 128) * 128)


def arch_has_bulk_copy(arch: str) -> bool:
    """sm_90 and later have cp.async.bulk + mbarrier tx counts (the preload and the weight ring need them)."""
    digits = "".join(ch for ch in arch[3:] if ch.isdigit())
    return arch.startswith("sm_") and bool(digits) and int(digits) >= 90


def pack_queues(program: MegakernelProgram) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32 [n_queues+1], items int32 [n_tasks]): CSR of the per-SM queues as instruction indices."""
    index = {t.id: i for i, t in enumerate(program.tasks)}
    items = [index[tid] for q in program.queues for tid in q]
    offs = np.zeros(len(program.queues) + 1, dtype=np.int32)
    offs[1:] = np.cumsum([len(q) for q in program.queues])
    return offs, np.asarray(items, dtype=np.int32)


def pack_buffers(program: MegakernelProgram, buffer_ptr: Callable[[int], int]) -> np.ndarray:
    out = np.zeros(len(program.buffers), dtype=abi.BUFDESC_DTYPE)
    for i, b in enumerate(program.buffers):
        out[i]["ptr"], out[i]["numel"] = buffer_ptr(b.id), b.numel
        out[i]["dtype"], out[i]["kind"] = abi.DTYPE_CODES[device_dtype(b).value], KIND_CODES[b.kind]
    return out


def static_checks(program: MegakernelProgram) -> None:
    """Safety checks that hold even with check=False: ids, caps, every access inside its buffer, queue indices."""
    nb, nc = len(program.buffers), len(program.counters)
    for i, b in enumerate(program.buffers):
        if b.id != i:
            raise MegakernelError(f"buffer {b.name!r}: id {b.id} != position {i}")
    ids = {t.id for t in program.tasks}
    for q, queue in enumerate(program.queues):
        for tid in queue:
            if tid not in ids:
                raise MegakernelError(f"queue {q}: unknown task id {tid}")
    numel = lambda i: program.buffers[i].numel  # noqa: E731
    for t in program.tasks:
        for bid in list(t.inputs) + list(t.outputs):
            if not 0 <= bid < nb:
                raise MegakernelError(f"task {t.id} ({t.op}): buffer id {bid} out of range")
        for c in [w.counter for w in t.waits] + ([t.out_counter] if t.out_counter >= 0 else []):
            if not 0 <= c < nc:
                raise MegakernelError(f"task {t.id} ({t.op}): counter {c} out of range [0, {nc})")
        if t.op not in abi.OPCODES:
            raise MegakernelError(f"task {t.id}: unknown opcode {t.op!r}")
        try:
            acc = accesses(t, numel)
        except (KeyError, ValueError, TypeError) as e:
            raise MegakernelError(f"task {t.id} ({t.op}): bad params ({e})") from None
        for a in acc:
            if a.lo < 0 or a.hi > numel(a.buffer):
                b = program.buffers[a.buffer]
                raise MegakernelError(f"task {t.id} ({t.op}): slot {a.slot} reads/writes [{a.lo}, {a.hi}) of buffer "
                                      f"{b.id} '{b.name}' with {b.numel} elements")


@dataclass(frozen=True)
class BuildChoice:
    """What select_build decided for a program on a device (MegakernelVM's shared-memory plan starts from it)."""
    spec: Any             # vm.jit.BuildSpec
    op_smem: int          # bytes of the largest op area
    optin: int            # the device's opt-in shared memory per block
    preload_want: int     # preload bytes the knobs ask for
    attn: tuple[int, int]  # attention (stages, stage bytes) of the build


def merge_unroll_for(program: MegakernelProgram) -> int:
    """ATTN_MERGE's largest unrolled body to compile (AMK_MERGE_UNROLL): the smallest of 4 / 8 / 16 that covers the
    program's most splits per merge, 4 where no merge has more than 16 splits (they take the loop) or there is none.
    Fewer unrolled bodies make the op's machine code smaller, which a merge running with a cold instruction cache
    measured faster (docs/PERF.md, twenty-eighth session)."""
    ns = max([int(t.params["n_splits"]) for t in program.tasks if t.op == "ATTN_MERGE"] + [0])
    return next((u for u in (4, 8, 16) if ns <= u), 4)


def select_build(program: MegakernelProgram, device, threads: int, prefetch_depth: int, tma: bool | None = None,
                 preload_kb: int | None = None) -> BuildChoice:
    """The extension spec a program needs on ``device`` (a torch.device with an index): its weight / KV dtypes,
    early-KV copies, preload, and the weight ring (sm_90+), which shrinks or goes away where it does not fit next
    to the op area. Raises MegakernelError where a task cannot run on the device. Needs no weights."""
    import torch
    from vm import jit
    props = torch.cuda.get_device_properties(device)
    with torch.cuda.device(device):
        arch = jit.device_arch(device.index)
    knobs = launch_knobs(program.config)
    want = knobs["preload_bytes"] if preload_kb is None else int(preload_kb) * 1024
    # one build per set of weight / KV-cache element types: the other types' code paths are not compiled
    dtypes = jit.dtype_mask(device_dtype(b).value for b in program.buffers
                            if b.kind in (BufferKind.WEIGHT, BufferKind.KV_CACHE))
    # the early KV copies are compiled in only where some attention task carries the early_kv hint
    early = any(t.params.get("early_kv", 0) for t in program.tasks)
    ahead = any(int(t.params.get("early_kv", 0)) == 2 for t in program.tasks)   # (the stages then sit at the top)
    code = dict(preload=want > 0, dtypes=dtypes, attn_early=early, merge_unroll=merge_unroll_for(program),
                kv_ahead=ahead)
    spec = jit.spec_for(threads, prefetch_depth, arch, tma, **code)
    wbytes = lambda t: program.buffers[t.inputs[1]].dtype.nbytes if t.op in STREAM_OPS else 4  # noqa: E731
    attn = (spec.attn_stages, spec.attn_stage_bytes)
    for t in program.tasks:   # one key's K and V rows must fit an attention stage
        if t.op in ("ATTN_DECODE", "ATTN_PARTIAL"):
            eb = device_dtype(program.buffers[t.inputs[1]]).nbytes
            if attn_keys(int(t.params["head_dim"]), eb, spec.attn_stage_bytes) < 1:
                raise MegakernelError(f"task {t.id} ({t.op}): one key's K and V rows ({2 * int(t.params['head_dim']) * eb} "
                                      f"B) do not fit an attention stage of {spec.attn_stage_bytes} B "
                                      f"(AMK_ATTN_STAGE_BYTES)")
            G, hd = int(t.params["group"]), int(t.params["head_dim"])
            if int(t.params.get("qk_norm", 0)) and not attn_fold_fits(G, hd, threads, spec.attn_stage_bytes):
                raise MegakernelError(f"task {t.id} ({t.op}): its folded QK-norm's scratch (3.5 x head_dim = "
                                      f"{7 * hd // 2} floats) does not fit between the score area and the KV stages "
                                      f"(group {G}, {threads} threads, stages of {spec.attn_stage_bytes} B); lower "
                                      f"with fold_qk_norm false")
    # kv_ahead: every op area ends below the attention stage region at the top (128-byte aligned for the swizzle)
    region = kv_region_bytes(attn) if ahead else 0

    def area(t, stage_bytes: int) -> int:   # bytes from the op area's start to the end of what the task uses
        n = smem_floats(t, threads, wbytes(t), stage_bytes, attn, ahead) * 4
        return -(-n // 128) * 128 + region if ahead else n
    need = [(area(t, spec.stage_bytes if spec.tma else 0), t) for t in program.tasks]
    op_smem = max([16 + region] + [n for n, _ in need])
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or program.target.smem_per_block)
    if op_smem + STATIC_SMEM_RESERVE > optin:
        n, t = max(need, key=lambda x: x[0])
        raise MegakernelError(f"task {t.id} ({t.op}) needs {n} B of dynamic shared memory; the device allows "
                              f"{optin - STATIC_SMEM_RESERVE} B per block (opt-in {optin} B minus static use)")
    if spec.tma:
        fit = (optin - STATIC_SMEM_RESERVE - op_smem) // spec.stage_bytes
        if fit < spec.stages:
            spec = jit.spec_for(threads, prefetch_depth, arch, fit >= 2, stages=max(2, min(fit, spec.stages)), **code)
            if not spec.tma:   # no ring after all: op area without stash terms
                op_smem = max([16 + region] + [area(t, 0) for t in program.tasks])
    return BuildChoice(spec, op_smem, optin, want, attn)


# ------------------------------------------------------------------------------------------------------------------
# The VM
# ------------------------------------------------------------------------------------------------------------------
class MegakernelVM:
    """One program on one GPU. See the module docstring."""

    def __init__(self, program: MegakernelProgram, weights: dict[str, Any], device: str = "cuda",
                 timeout_s: float = 2.0, check: bool = True, threads: int | None = None,
                 prefetch_depth: int | None = None, tma: bool | None = None,
                 prefetch_fraction: float | None = None, wait_prefetch_kb: int | None = None,
                 preload_kb: int | None = None):
        import torch
        from vm import jit
        if check:
            from schedule.ir import validate
            res = validate(program)
            if not res.ok:
                raise MegakernelError("program rejected by validate():\n" + res.report())
        static_checks(program)
        self.program = program
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise MegakernelError(f"MegakernelVM needs a CUDA device, got {device!r}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(timeout_s)
        t_cfg, d_cfg = jit.knobs_from_config(program.config)
        self.threads = int(threads if threads is not None else t_cfg)
        self.prefetch_depth = int(prefetch_depth if prefetch_depth is not None else d_cfg)
        props = torch.cuda.get_device_properties(self.device)
        self.grid = len(program.queues)
        if self.grid < 1:
            raise MegakernelError("program has no queues")
        # -- build (no weights needed: scripts/ab_builds.py --jobs builds ahead through the same function) -------
        b = select_build(program, self.device, self.threads, self.prefetch_depth, tma, preload_kb)
        with torch.cuda.device(self.device):
            self.ext = jit.build(b.spec)
        self.spec, op_smem, optin, want, attn = b.spec, b.op_smem, b.optin, b.preload_want, b.attn
        knobs = launch_knobs(program.config)
        self.build_stats = dict(jit.LAST_BUILD)
        check_layout(self.ext.layout(), abi.layout_table())
        info = self.ext.build_info()
        self.build_info = info
        region = kv_region_bytes(attn) if b.spec.kv_ahead else 0
        if (info["threads"], info["prefetch_depth"], info["status_len"], info.get("attn_stages"),
                info.get("attn_stage_bytes"), info.get("kv_region")) != (self.threads, self.prefetch_depth,
                                                                         STATUS_LEN, *attn, region):
            raise MegakernelError(f"extension build info {info} does not match threads={self.threads}, "
                                  f"prefetch_depth={self.prefetch_depth}, status_len={STATUS_LEN}, "
                                  f"attention stages {attn}, KV region {region} B")
        self.ring_bytes = int(info.get("ring_bytes", 0))
        self._alloc(weights)
        # -- the preload buffer: what the knob asks for, within what is left next to ring and op area -----------
        room = optin - STATIC_SMEM_RESERVE - op_smem - self.ring_bytes
        preload_cap = min(want, room) // 128 * 128 if int(info.get("preload", 0)) and want > 0 else 0
        ptr = lambda bid: int(self.tensors[bid].data_ptr())  # noqa: E731
        self.instrs_np = pack_instructions(program, ptr, int(info["stage_bytes"]) if self.ring_bytes else 0,
                                           preload_cap=preload_cap)
        self.n_streamed = int(((self.instrs_np["flags"] & abi.INSTR_FLAG_STREAM) != 0).sum())
        self.n_preloaded = int(((self.instrs_np["flags"] & abi.INSTR_FLAG_PRELOAD) != 0).sum())
        self.n_kv_ahead = int(((self.instrs_np["flags"] & abi.INSTR_FLAG_KV_AHEAD) != 0).sum())
        self.kv_region_bytes = region   # the attention stages at the top of shared memory (kv_ahead builds)
        self.preload_bytes = preload_buffer_bytes(self.instrs_np)
        # -- launch geometry ----------------------------------------------------------------------------------
        self.smem_bytes = self.ring_bytes + self.preload_bytes + op_smem
        with torch.cuda.device(self.device):
            self.ext.prepare(self.smem_bytes)
            per_sm = int(self.ext.occupancy(self.smem_bytes))
        self.max_grid = per_sm * props.multi_processor_count
        if self.grid > self.max_grid:
            raise MegakernelError(f"grid of {self.grid} blocks (one per queue) exceeds the co-resident limit "
                                  f"{self.max_grid} ({per_sm} block(s)/SM x {props.multi_processor_count} SMs at "
                                  f"{self.threads} threads, {self.smem_bytes} B smem)")
        # -- tables ---------------------------------------------------------------------------------------------
        l2 = int(getattr(props, "L2_cache_size", 0) or program.target.l2_bytes)
        self.prefetch_cap = prefetch_cap_bytes(l2, self.grid, self.prefetch_depth, prefetch_fraction)
        self.wait_prefetch_bytes = (knobs["wait_prefetch_bytes"] if wait_prefetch_kb is None
                                    else int(wait_prefetch_kb) * 1024)
        self.wait_prefetch_next_bytes = knobs["wait_prefetch_next_bytes"]
        self.wait_prefetch_pace_bytes = knobs["wait_prefetch_pace_bytes"]
        offs, items = pack_queues(program)
        self.bufs_np = pack_buffers(program, ptr)
        dev = self.device
        self.instrs = torch.from_numpy(self.instrs_np.view(np.uint8).copy()).to(dev)
        self.bufs = torch.from_numpy(self.bufs_np.view(np.uint8).copy()).to(dev)
        self.queue_offsets = torch.from_numpy(offs).to(dev)
        self.queue_items = torch.from_numpy(items if len(items) else np.zeros(1, np.int32)).to(dev)
        self.n_counters = len(program.counters)
        self.status_offset = _pad4(max(1, self.n_counters))
        self.sync = torch.zeros(self.status_offset + STATUS_LEN, dtype=torch.int32, device=dev)
        self.counters = self.sync[:self.status_offset]
        self.status = self.sync[self.status_offset:]
        self._graphs: dict[int, Any] = {}     # chunk -> (CUDAGraph, hist tensor) or None (capture failed)
        self._trace_ptr = 0

    # -- storage --------------------------------------------------------------------------------------------------
    def _alloc(self, weights: dict[str, Any]) -> None:
        import torch
        from vm.reference_vm import TORCH_DTYPES
        dev = self.device
        self.tensors: dict[int, torch.Tensor] = {}
        shared: dict[tuple, torch.Tensor] = {}
        for b in self.program.buffers:
            tdt = TORCH_DTYPES[device_dtype(b)]
            if b.kind == BufferKind.WEIGHT:
                key = (b.storage_key, tdt)
                if key not in shared:
                    w = find_weight(b, weights, MegakernelError)
                    shared[key] = w.detach().to(device=dev, dtype=tdt).contiguous()
                t = shared[key]
            elif b.kind == BufferKind.CONST:
                if b.data is None or len(b.data) != b.numel:
                    raise MegakernelError(f"buffer {b.id} '{b.name}': CONST data has "
                                          f"{0 if b.data is None else len(b.data)} values, shape needs {b.numel}")
                t = torch.tensor(b.data, dtype=tdt).view(b.shape).to(dev)
            elif b.kind == BufferKind.KV_CACHE:
                t = torch.zeros(b.shape, dtype=tdt, device=dev)
            else:
                t = torch.zeros(max(1, b.numel), dtype=tdt, device=dev)
            self.tensors[b.id] = t
        io = {b.name: b.id for b in self.program.buffers if b.kind in (BufferKind.IO_INPUT, BufferKind.IO_OUTPUT)}
        for name in ("token", "pos", "logits", "next_token"):
            if name not in io:
                raise MegakernelError(f"program has no IO buffer named {name!r}")
        self.token, self.pos = self.tensors[io["token"]], self.tensors[io["pos"]]
        self.logits, self.next_token = self.tensors[io["logits"]], self.tensors[io["next_token"]]
        self._io_ptrs = (int(self.token.data_ptr()), int(self.pos.data_ptr()), int(self.next_token.data_ptr()))
        self.kv = [self.tensors[b.id] for b in self.program.buffers if b.kind == BufferKind.KV_CACHE]
        self.max_seq = min([int(b.shape[1]) for b in self.program.buffers if b.kind == BufferKind.KV_CACHE] or [0])

    def buffer(self, name: str):
        """The device tensor of a buffer, by name."""
        return self.tensors[self.program.buffer(name).id]

    # -- launching ------------------------------------------------------------------------------------------------
    def _launch(self, flags: int = 0, token: int = 0, pos: int = 0, out_slot=None) -> None:
        """One launch. The kernel's last block resets the counters and does the step's IO bookkeeping (amk_exit in
        megakernel.cu): flags IO_TOKEN / IO_POS: this step's token id / position come from ``token`` / ``pos`` (and
        are stored into their buffers); IO_ADVANCE: afterwards token = next_token, pos += 1, out_slot = next_token."""
        io = [flags, token, pos, self._io_ptrs[0], self._io_ptrs[1], self._io_ptrs[2],
              int(out_slot.data_ptr()) if out_slot is not None else 0]
        self.ext.launch(self.instrs, self.queue_offsets, self.queue_items, self.bufs, self.sync, self.n_counters,
                        self.status_offset, self.grid, self.smem_bytes, int(self.timeout_s * 1e9), self.prefetch_cap,
                        self._trace_ptr, self.wait_prefetch_bytes, self.preload_bytes,
                        self.wait_prefetch_next_bytes, self.wait_prefetch_pace_bytes, io)

    def trace_step(self, token=None, pos=None) -> dict:
        """One checked step with per-task timestamps -> {"t0", "t1", "t2" (ns, relative to the first wait begin),
        "sm", "smid", "marks"} numpy arrays indexed like program.tasks (t0: reached, t1: waits satisfied, t2: done;
        sm: the queue (block) that ran it, smid: the physical SM that block was on (%smid); marks
        [n_tasks, 4]: op entry, input staged, main loop done, closing barrier passed -- -1 where an op sets none)."""
        import torch
        words = int(self.build_info.get("trace_words", 4))
        tr = torch.zeros(len(self.program.tasks) * words, dtype=torch.int64, device=self.device)
        self._trace_ptr = int(tr.data_ptr())
        try:
            self.step(token, pos, check=True)
        finally:
            self._trace_ptr = 0
        a = tr.view(-1, words).cpu().numpy().astype(np.int64)
        base = a[:, 0][a[:, 0] > 0].min() if (a[:, 0] > 0).any() else 0
        marks = np.where(a[:, 4:] > 0, a[:, 4:] - base, -1)
        return {"t0": a[:, 0] - base, "t1": a[:, 1] - base, "t2": a[:, 2] - base, "sm": a[:, 3] & 0xFFFFFFFF,
                "smid": a[:, 3] >> 32, "marks": marks}

    @staticmethod
    def _set(dst, value) -> None:
        import torch
        if isinstance(value, torch.Tensor):
            dst.copy_(value.reshape(1))
        else:
            dst.fill_(int(value))

    def launch_async(self, token: int | None = None, pos: int | None = None) -> None:
        """Launch one step on the current stream (no host sync, no check): ONE stream operation. The counters are
        0 between launches (the kernel's last block resets them); int token / pos travel in the launch params.
        Errors are sticky: after one, every launch exits at once until check_status() reports and clears it."""
        flags = (IO_TOKEN if token is not None else 0) | (IO_POS if pos is not None else 0)
        self._launch(flags, int(token or 0), int(pos or 0))

    def step(self, token=None, pos=None, check: bool = True):
        """One decode step -> logits (device fp32 [vocab], the live buffer). token/pos: int (passed in the launch
        params, no extra stream operation) or device tensor (copied into the IO buffer first)."""
        import torch
        if isinstance(token, torch.Tensor):
            self._set(self.token, token)
            token = None
        if isinstance(pos, torch.Tensor):
            self._set(self.pos, pos)
            pos = None
        for name, v in (("token", token), ("pos", pos)):
            if v is not None and not -2**31 <= int(v) < 2**31:
                raise MegakernelError(f"step: {name} {v} is outside int32")
        self.launch_async(token, pos)
        if check:
            self.check_status()
        return self.logits

    def check_status(self) -> None:
        """Synchronise and raise MegakernelError if the last launch(es) reported an error."""
        import torch
        with torch.cuda.device(self.device):
            torch.cuda.current_stream().synchronize()
        st = self.status.cpu().tolist()
        code, task, opcode, detail, sm = st[:5]
        if code == abi.STATUS_OK and not any(st[5:]):
            return
        msg = (self._describe(code, task, opcode, detail, sm) if code != abi.STATUS_OK else
               f"megakernel status words {st[5:]} (abort flag, exit count) not clear after a launch without an error")
        self.sync.zero_()   # counters, abort flag, exit count: an aborted launch leaves them for this report
        raise MegakernelError(msg)

    def _describe(self, code, task, opcode, detail, sm) -> str:
        spec = abi.OPCODE_BY_CODE.get(opcode)
        opname = spec.name if spec else f"unknown opcode {opcode}"
        t = next((x for x in self.program.tasks if x.id == task), None)
        where = f"task {task} ({opname}{', ' + t.label if t is not None and t.label else ''}) on SM {sm}"
        if code == abi.STATUS_BAD_OPCODE:
            known = ", ".join(f"{s.code}={s.name}" for s in abi.OPCODE_BY_CODE.values())
            return (f"megakernel trap: unknown opcode {opcode} in task {task} (instruction {detail}) on SM {sm}; "
                    f"known opcodes: {known}")
        if code == abi.STATUS_TIMEOUT and detail == PRELOAD_DETAIL:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} waited for its preloaded weight "
                    f"tile (bulk copy never completed)")
        if code == abi.STATUS_TIMEOUT and detail < 0:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} waited for weight-ring slot "
                    f"{-1 - detail} (bulk copy never completed)")
        if code == abi.STATUS_TIMEOUT:
            idx = next((i for i, x in enumerate(self.program.tasks) if x.id == task), None)
            thr = "?"
            if idx is not None:
                r = self.instrs_np[idx]
                for k in range(int(r["n_waits"])):
                    if int(r["wait_counter"][k]) == detail:
                        thr = int(r["wait_threshold"][k])
            val = int(self.counters[detail].item()) if 0 <= detail < self.n_counters else "?"
            cname = self.program.counters[detail].name if 0 <= detail < self.n_counters else "?"
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} waited on counter {detail} "
                    f"('{cname}') for >= {thr}, value {val}")
        if code == abi.STATUS_BAD_INPUT:
            if detail in DTYPE_DETAILS:
                what = (f"this kernel build has no code for element type {DTYPE_DETAILS[detail]} (built for mask "
                        f"{self.build_info.get('dtypes')}); the VM builds for its program's types")
            elif opname == "EMBED":
                what = f"token id {detail} outside the vocabulary"
            elif opname in ("QKV_ROPE", "QK_NORM_ROPE", "ATTN_DECODE", "ATTN_PARTIAL"):
                what = f"position {detail} outside the KV cache [0, {self.max_seq})"
            else:
                what = f"needs {detail} B of shared memory, launch has {self.smem_bytes} B"
            return f"megakernel bad input: {where}: {what}"
        return f"megakernel status code {code} at {where} (detail {detail})"

    # -- decode loop ----------------------------------------------------------------------------------------------
    def _step_device(self, out_slot) -> None:
        """One greedy step entirely on the device, one launch: its last block stores out_slot = token = next_token
        and pos += 1 (IO_ADVANCE)."""
        self._launch(IO_ADVANCE, out_slot=out_slot)

    def prepare_decode(self, chunk: int) -> bool:
        """Capture a CUDA graph of ``chunk`` device steps (once per chunk size). False if capture is unsupported."""
        import torch
        if chunk in self._graphs:
            return self._graphs[chunk] is not None
        hist = torch.zeros(chunk, dtype=torch.int32, device=self.device)  # the graph writes its tokens here
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(g):
                for j in range(chunk):
                    self._step_device(hist[j:j + 1])
        except RuntimeError as e:  # cooperative launches not capturable on this driver: run eagerly
            import warnings
            warnings.warn(f"CUDA graph capture of the decode step failed ({e}); decoding without graphs")
            self._graphs[chunk] = None
            return False
        self._graphs[chunk] = (g, hist)
        return True

    def decode_device(self, n_tokens: int, first_token=None, start_pos=None, use_graph: bool = True):
        """Greedy-decode n_tokens on the device -> int32 device tensor [n_tokens]; no host sync.
        first_token / start_pos None = continue from the device state (token = last output, pos advanced).
        Status is reset once here and is sticky across the steps (a failed step makes the rest exit at once)."""
        import torch
        if isinstance(start_pos, int) and self.max_seq and start_pos + n_tokens > self.max_seq:
            raise MegakernelError(f"decode: positions up to {start_pos + n_tokens - 1} exceed the KV cache "
                                  f"({self.max_seq} positions)")
        if first_token is not None:
            self._set(self.token, first_token)
        if start_pos is not None:
            self._set(self.pos, start_pos)
        self.sync.zero_()   # status (sticky errors) and counters: a launch that failed unchecked left both
        out = torch.empty(n_tokens, dtype=torch.int32, device=self.device)
        entry = self._graphs.get(n_tokens) if use_graph else None
        if entry is not None:
            g, hist = entry
            g.replay()
            out.copy_(hist)
        else:
            for i in range(n_tokens):
                self._step_device(out[i:i + 1])
        return out

    def decode(self, first_token: int, start_pos: int, n_tokens: int, chunk: int = 32,
               use_graph: bool = True) -> list[int]:
        """Greedy decode: feed first_token at start_pos, then each output back. One host sync per chunk."""
        if n_tokens <= 0:
            return []
        if self.max_seq and start_pos + n_tokens > self.max_seq:
            raise MegakernelError(f"decode: positions up to {start_pos + n_tokens - 1} exceed the KV cache "
                                  f"({self.max_seq} positions)")
        toks: list[int] = []
        first = True
        while len(toks) < n_tokens:
            k = min(chunk, n_tokens - len(toks))
            if use_graph and k == chunk:
                self.prepare_decode(k)
            out = self.decode_device(k, first_token if first else None, start_pos if first else None, use_graph)
            first = False
            toks += out.tolist()          # the one sync of this chunk
            self.check_status()
        return toks

    def generate(self, prompt: list[int], n_new: int, chunk: int = 32) -> list[int]:
        """Prefill ``prompt`` token by token from position 0, then greedy-decode n_new tokens (like HF generate)."""
        if not prompt:
            raise MegakernelError("generate: empty prompt")
        for i, t in enumerate(prompt[:-1]):
            self.step(int(t), i)
        return self.decode(int(prompt[-1]), len(prompt) - 1, n_new, chunk)

    def reset(self) -> None:
        """Zero the KV caches."""
        for t in self.kv:
            t.zero_()

    # -- test hooks -------------------------------------------------------------------------------------------
    def patch_instr(self, index: int, **fields) -> None:
        """Overwrite fields of packed instruction ``index`` (e.g. op=99, wait_threshold=[...]) and re-upload."""
        import torch
        rec = self.instrs_np[index]
        for k, v in fields.items():
            if k not in abi.INSTR_DTYPE.names:
                raise KeyError(f"AmkInstr has no field {k!r}")
            rec[k] = v
        self.instrs.copy_(torch.from_numpy(self.instrs_np.view(np.uint8).copy()).to(self.device))

    @property
    def weight_bytes(self) -> int:
        return self.program.weight_bytes

    def __repr__(self) -> str:
        return (f"MegakernelVM({len(self.program.tasks)} tasks, grid {self.grid}, {self.threads} threads, "
                f"smem {self.smem_bytes} B (ring {self.ring_bytes} B, {self.n_streamed} streamed tasks; preload "
                f"{self.preload_bytes} B, {self.n_preloaded} preloaded tasks; KV region {self.kv_region_bytes} B, "
                f"{self.n_kv_ahead} tasks issue the next task's KV), "
                f"prefetch depth {self.prefetch_depth} cap {self.prefetch_cap} B)")


def roofline_us(weight_bytes: int, gbps: float = 3050.0) -> float:
    """Weight-streaming floor of one token in microseconds."""
    return weight_bytes / (gbps * 1e9) * 1e6 if gbps > 0 else math.inf
