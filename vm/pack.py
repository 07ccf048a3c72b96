"""The CPU half of the POD loader (vm/loader.py is the GPU half): a MegakernelProgram packed into the tables of
vm/abi.py (instructions, queues, buffer descriptors), the checks a program must pass before anything is built or
uploaded, the ABI layout check against the built extension, and the kernel build a program needs on a device
(select_build). Everything here runs without a GPU except select_build, which reads the device's properties."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from schedule.ir import BufferKind, DType, MegakernelProgram
from schedule.ops import accesses, is_dyn, kv_ahead_issuer_ok, weight_ranges
from vm import abi
from vm.smem import STREAM_OPS, attn_fold_fits, attn_keys, kv_region_bytes, smem_floats

KIND_CODES = {k: abi.KIND_CODES[k.value] for k in BufferKind}
STATUS_LEN = 8                 # AMK_STATUS_LEN: report words + abort flag + exit count
IO_TOKEN, IO_POS, IO_ADVANCE = 1, 2, 4   # AMK_IO_* (amk_launch.h): the launch's io_flags
STATIC_SMEM_RESERVE = 2048     # bytes of static shared memory of the kernel (704 B measured) + margin
DTYPE_DETAILS = {-200 - code: name for name, code in abi.DTYPE_CODES.items()}   # AMK_DTYPE_DETAIL - dtype (common.cuh)
PRELOAD_DETAIL = -100         # AMK_PRELOAD_DETAIL (vm/csrc/preload.cuh): TIMEOUT detail of the preload barrier
FLAG_DETAIL = -101            # AMK_FLAG_DETAIL (vm/csrc/sync.cuh): TIMEOUT detail of a data-flagged input's poll
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


def device_code(b) -> str:
    """The buffer's device storage type name (a key of abi.DTYPE_CODES): device_dtype's, or 'f32x' for a
    data-flagged activation (8 bytes per element: value | launch tag << 32, vm/csrc/sync.cuh)."""
    return "f32x" if b.flagged else device_dtype(b).value


def _int_knobs(config, *names: str) -> list[int]:
    """The integer values of knobs ``names`` in a ScheduleConfig (or its dict), defaults for the missing ones."""
    from flywheel.prior import KNOB_BY_NAME
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return [int(d.get(k, KNOB_BY_NAME[k].default)) for k in names]


def launch_knobs(config) -> dict[str, int]:
    """The launch parameters a ScheduleConfig (dict) sets on an already built kernel (knobs with affects='launch')."""
    kb, pk, nk, pace = _int_knobs(config, "wait_prefetch_kb", "preload_kb", "wait_prefetch_next_kb",
                                  "wait_prefetch_pace_kb")
    return {"wait_prefetch_bytes": kb * 1024, "preload_bytes": pk * 1024, "wait_prefetch_next_bytes": nk * 1024,
            "wait_prefetch_pace_bytes": pace * 1024}


def ring_knobs(config) -> dict[str, int]:
    """The weight ring a ScheduleConfig (dict) asks for, as vm.jit.spec_for arguments (stages, stage_bytes,
    ring_window; a window of 0 is spec_for's auto); {} where ring_stages is 0: the build then follows MegakernelVM's
    ``tma`` argument and the AMK_* environment, as the A/B scripts set it."""
    stages, kb, window = _int_knobs(config, "ring_stages", "ring_stage_kb", "ring_window")
    return {"stages": stages, "stage_bytes": kb * 1024, "ring_window": window} if stages else {}


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
            if w.data:   # the op polls its data-flagged inputs itself (flag_hops)
                r["flags"] |= abi.INSTR_FLAG_WAIT_DATA0 << k
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
        out[i]["dtype"], out[i]["kind"] = abi.DTYPE_CODES[device_code(b)], KIND_CODES[b.kind]
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
    ring_requested: int = 0  # weight-ring stages the knobs asked for (0: no ring asked); spec.stages may be fewer


def fit_ring_stages(optin: int, op_smem: int, stage_bytes: int, stages: int) -> int:
    """Weight-ring stages of ``stage_bytes`` that fit next to an op area of ``op_smem`` bytes in a block's opt-in
    shared memory (the kernel's static use reserved), at most ``stages``; below 2 the build has no ring."""
    return max(0, min(int(stages), (int(optin) - STATIC_SMEM_RESERVE - int(op_smem)) // int(stage_bytes)))


def ring_shrink_note(requested: int, fitted: int, stage_bytes: int, op_smem: int, optin: int) -> str:
    """What select_build did to a weight ring that did not fit (for the loader's warning and the A/B rows)."""
    what = f"{fitted} fit" if fitted >= 2 else "fewer than 2 fit, so the build has no ring (register streaming)"
    return (f"weight ring: {requested} stages of {stage_bytes} B asked, {what} next to the largest op area "
            f"({op_smem} B) in {optin} B of shared memory per block")


def merge_unroll_for(program: MegakernelProgram) -> int:
    """ATTN_MERGE's largest unrolled body to compile (AMK_MERGE_UNROLL): the smallest of 4 / 8 / 16 that covers the
    program's most splits per merge, 4 where no merge has more than 16 splits (they take the loop) or there is none.
    Fewer unrolled bodies make the op's machine code smaller, which a merge running with a cold instruction cache
    measured faster (docs/PERF.md, twenty-eighth session)."""
    ns = max([int(t.params["n_splits"]) for t in program.tasks if t.op == "ATTN_MERGE"] + [0])
    return next((u for u in (4, 8, 16) if ns <= u), 4)


def build_trims(program: MegakernelProgram) -> dict:
    """The code a program's tasks can reach, as vm.jit.spec_for arguments: its opcodes (``ops``: the others are
    compiled out and would fail as unknown opcodes), its attention head dims (``attn_hds``: bit 0 = 64, bit 1 = 128;
    the tensor-core body is compiled per head dim), whether an attention task folds QK-norm (``qk_fold``) and
    whether an o_proj merges one KV group's partials into the residual (``group_early``: x_splits with
    accumulate). The llama-3.2-1b build shrinks from 671 to 420 KB of SASS; measured -0.3% on an H100, equal on an
    H200 (docs/PERF.md, forty-eighth session)."""
    attn = [t for t in program.tasks if t.op in ("ATTN_DECODE", "ATTN_PARTIAL")]
    hds = {int(t.params["head_dim"]) for t in attn}
    return dict(ops=sum({1 << abi.OPCODES[t.op].code for t in program.tasks}),
                attn_hds=int(64 in hds) | int(128 in hds) << 1,
                qk_fold=any(int(t.params.get("qk_norm", 0)) for t in attn),
                group_early=any(t.op == "GEMV" and int(t.params.get("x_splits", 0)) > 0
                                and int(t.params.get("accumulate", 0)) for t in program.tasks))


def select_build(program: MegakernelProgram, device, threads: int, prefetch_depth: int, tma: bool | None = None,
                 preload_kb: int | None = None) -> BuildChoice:
    """The extension spec a program needs on ``device`` (a torch.device with an index): its weight / KV dtypes,
    early-KV copies, preload, and the weight ring (sm_90+: the config's ring_* knobs, else ``tma`` and the AMK_*
    environment; ``tma=False`` none), which shrinks (with a warning by the loader) or goes away where it does not
    fit next to the op area. Raises MegakernelError where a task cannot run on the device. Needs no weights."""
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
                kv_ahead=ahead, flags=any(b.flagged for b in program.buffers),
                **({} if os.environ.get("AMK_NO_TRIM", "0") != "0" else build_trims(program)))
    ring = ring_knobs(program.config)   # the config's ring (ring_stages > 0) wins over the AMK_* environment
    if ring and tma is not False:
        tma = True
        code.update(ring)
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
    requested = spec.stages if spec.tma else 0
    if spec.tma:
        fit = fit_ring_stages(optin, op_smem, spec.stage_bytes, spec.stages)
        if fit < spec.stages:
            try:   # (the window as asked: an auto one follows the fewer stages, an asked one may not fit them)
                code.update(stages=max(2, fit), stage_bytes=spec.stage_bytes)
                spec = jit.spec_for(threads, prefetch_depth, arch, fit >= 2, **code)
            except jit.BuildError as e:   # e.g. a ring_window the fewer stages cannot take
                raise MegakernelError(ring_shrink_note(requested, fit, spec.stage_bytes, op_smem, optin) +
                                      f": {e}") from e
            if not spec.tma:   # no ring after all: op area without stash terms
                op_smem = max([16 + region] + [area(t, 0) for t in program.tasks])
    return BuildChoice(spec, op_smem, optin, want, attn, requested)
