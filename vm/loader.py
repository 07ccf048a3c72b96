"""MegakernelVM: packs a MegakernelProgram into the POD tables of vm/abi.py, uploads it once, and runs one
cooperative persistent launch per decode step.

    vm = MegakernelVM(program, weights)                 # validate, JIT build, layout check, upload
    logits = vm.step(token, pos)                        # device fp32 [vocab] (live buffer: clone() to keep it)
    toks = vm.decode(first_token, start_pos, n_tokens)  # greedy, zero host syncs per token (one per chunk)
    out = vm.decode_device(n, first_token, start_pos)   # same on the device only (CUDA-graph replay if prepared)
    tr = vm.trace_step()                                # per-task %globaltimer stamps (wait begin, ready, end, SM)

Build knobs come from ``program.config`` (threads_per_block, prefetch_depth; ring_stages > 0 with ring_stage_kb and
ring_window: the sm_90 bulk-copy weight ring, vm/csrc/stream.cuh, opt-in) and can be overridden; ``tma=True`` selects
the ring with the AMK_STAGES / AMK_STAGE_BYTES / AMK_RING_WINDOW geometry where the config asks for none, ``tma=False``
none at all; ``prefetch_fraction`` the L2 share of the
look-ahead prefetch window, ``preload_kb`` (default: the config's knob) the whole-tile weight preload buffer
(vm/csrc/preload.cuh, sm_90+ builds without the ring). Errors raised by a launch name the task, opcode, SM and,
for timeouts, the counter.

Device state (all allocated once): weights (tied ones share storage), KV caches zeroed in their dtype, CONST
tables from ``Buffer.data``, fp32 activations, the instruction / queue / buffer-descriptor tables, and one int32
``sync`` tensor = counters | status words. A step is ONE launch: int token / pos travel in the launch params, and
the kernel's last block resets the counters and stores the step's IO (greedy decode: token = next_token, pos += 1)
for the next launch (amk_exit in vm/csrc/megakernel.cu; a memset and two fills per step were ~7.7 us of stream gaps
on an H100, docs/PERF.md). An aborted launch leaves counters and status for the report; check_status() clears them.
The pure functions ``pack_instructions``, ``pack_buffers``, ``pack_queues``, ``static_checks`` and
``check_layout`` live in vm/pack.py (the shared-memory layout in vm/smem.py); they run on CPU (tests use them without
a GPU).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from schedule.ir import BufferKind, MegakernelProgram, find_weight, name_step, step_name
from vm import abi
from vm.pack import (  # noqa: F401 (AbiMismatchError: re-exported with the errors the VM raises)
    DTYPE_DETAILS, FLAG_DETAIL, IO_ADVANCE, IO_POS, IO_TOKEN, PRELOAD_DETAIL, STATIC_SMEM_RESERVE, STATUS_LEN,
    AbiMismatchError,
    MegakernelError, check_layout, device_dtype, launch_knobs, pack_buffers, pack_instructions, pack_queues,
    prefetch_cap_bytes, preload_buffer_bytes, ring_shrink_note, select_build, static_checks)
from vm.smem import _pad4, kv_region_bytes

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
        # the ring as built: select_build shrinks one that does not fit next to the op area, and says so
        self.ring_stages = b.spec.stages if b.spec.tma else 0
        self.ring_stages_requested = b.ring_requested
        if b.ring_requested and self.ring_stages < b.ring_requested:
            warnings.warn(ring_shrink_note(b.ring_requested, self.ring_stages, b.spec.stage_bytes, op_smem, optin),
                          stacklevel=2)
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
        # the launch's positions and next tokens: one int32 array each, step s's buffer at element s (the kernel's
        # last block advances them together: amk_exit)
        self.n_steps = n = io_steps(self.program)
        self.pos_all = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tokens_all = torch.zeros(n, dtype=torch.int32, device=dev)
        self._step_offsets = torch.arange(n, dtype=torch.int32, device=dev)
        per_step = {step_name(name, s): arr[s:s + 1] for s in range(n)
                    for name, arr in (("pos", self.pos_all), ("next_token", self.tokens_all))}
        for b in self.program.buffers:
            tdt = TORCH_DTYPES[device_dtype(b)]
            if b.name in per_step and b.kind in (BufferKind.IO_INPUT, BufferKind.IO_OUTPUT):
                if tdt != torch.int32 or b.numel != 1:
                    raise MegakernelError(f"buffer {b.id} '{b.name}': a position / token IO buffer must be one int32, "
                                          f"got {b.numel} x {b.dtype.value}")
                t = per_step[b.name]
            elif b.kind == BufferKind.WEIGHT:
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
            elif b.flagged:   # 8-byte words: value | launch tag << 32 (tag 0: never written)
                t = torch.zeros(max(1, b.numel), dtype=torch.int64, device=dev)
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
        # every step's logits, in step order ('logits', 'logits@1', ...)
        self.step_logits = [self.tensors[io[step_name("logits", s)]] for s in range(n)]
        self.kv = [self.tensors[b.id] for b in self.program.buffers if b.kind == BufferKind.KV_CACHE]
        self.flagged_tensors = [self.tensors[b.id] for b in self.program.buffers if b.flagged]   # (reset_sync)
        self.max_seq = min([int(b.shape[1]) for b in self.program.buffers if b.kind == BufferKind.KV_CACHE] or [0])

    def buffer(self, name: str):
        """The device tensor of a buffer, by name."""
        return self.tensors[self.program.buffer(name).id]

    # -- launching ------------------------------------------------------------------------------------------------
    def _launch(self, flags: int = 0, token: int = 0, pos: int = 0, out_slot=None) -> None:
        """One launch (n_steps decode steps). The kernel's last block resets the counters and does the launch's IO
        bookkeeping (amk_exit in megakernel.cu): flags IO_TOKEN / IO_POS: the first step's token id / position come
        from ``token`` / ``pos`` (and are stored into their buffers; step s is at pos + s); IO_ADVANCE: afterwards
        token = the last step's next token, pos += n_steps, out_slot[0:n_steps] = the steps' next tokens."""
        if out_slot is not None and out_slot.numel() < self.n_steps:
            raise MegakernelError(f"out_slot holds {out_slot.numel()} tokens, the launch makes {self.n_steps}")
        io = [flags, token, pos, self._io_ptrs[0], self._io_ptrs[1], self._io_ptrs[2],
              int(out_slot.data_ptr()) if out_slot is not None else 0, self.n_steps]
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

    def _set_pos(self, value) -> None:
        """The launch's positions from the first: pos[s] = value + s (int or device tensor), one small kernel."""
        import torch
        if isinstance(value, torch.Tensor):
            value = value.reshape(1).to(device=self.device, dtype=torch.int32)
        else:
            value = int(value)
        torch.add(self._step_offsets, value, out=self.pos_all)

    def launch_async(self, token: int | None = None, pos: int | None = None) -> None:
        """Launch one step on the current stream (no host sync, no check): ONE stream operation. The counters are
        0 between launches (the kernel's last block resets them); int token / pos travel in the launch params (a
        multi-step program's positions are written first: one more stream operation, amk_io_value in common.cuh).
        Errors are sticky: after one, every launch exits at once until check_status() reports and clears it."""
        if pos is not None and self.n_steps > 1:   # the kernel takes only step 0's position from its params
            self._set_pos(pos)
            pos = None
        flags = (IO_TOKEN if token is not None else 0) | (IO_POS if pos is not None else 0)
        self._launch(flags, int(token or 0), int(pos or 0))

    def step(self, token=None, pos=None, check: bool = True):
        """One launch from ``token`` at ``pos`` -> the logits of that token (device fp32 [vocab], the live buffer).
        token/pos: int (passed in the launch params, no extra stream operation) or device tensor (copied into the
        IO buffer first). A multi-step program (n_steps > 1) also runs the n_steps - 1 greedy steps after it, at
        pos + 1, ...: their logits are ``step_logits[1:]``, their tokens ``tokens_all``; the KV rows they append
        are rewritten by whatever later runs at those positions."""
        import torch
        if isinstance(token, torch.Tensor):
            self._set(self.token, token)
            token = None
        if isinstance(pos, torch.Tensor):
            self._set_pos(pos)
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
        if code == abi.STATUS_OK and not any(st[5:7]):
            return
        msg = (self._describe(code, task, opcode, detail, sm) if code != abi.STATUS_OK else
               f"megakernel status words {st[5:7]} (abort flag, exit count) not clear after a launch without an error")
        self.reset_sync()   # counters, abort flag, exit count: an aborted launch leaves them for this report
        raise MegakernelError(msg)

    def reset_sync(self) -> None:
        """Zero the counters and status words -- the launch epoch too -- and with it every data-flagged buffer
        (flag_hops): an aborted launch may have left words tagged for an epoch the next launches would count again."""
        self.sync.zero_()
        for t in self.flagged_tensors:
            t.zero_()

    def read_activation(self, name: str):
        """An activation's values as fp32 (a copy; a data-flagged buffer's words decoded: their low 32 bits)."""
        import torch
        b = self.program.buffer(name)
        t = self.tensors[b.id]
        if b.flagged:
            return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32).clone()
        return t.clone()

    def _describe(self, code, task, opcode, detail, sm) -> str:
        spec = abi.OPCODE_BY_CODE.get(opcode)
        opname = spec.name if spec else f"unknown opcode {opcode}"
        t = next((x for x in self.program.tasks if x.id == task), None)
        where = f"task {task} ({opname}{', ' + t.label if t is not None and t.label else ''}) on SM {sm}"
        if code == abi.STATUS_BAD_OPCODE and spec is not None and not self.spec.ops >> opcode & 1:
            return (f"megakernel trap: opcode {opcode} ({spec.name}) in task {task} (instruction {detail}) on SM {sm} "
                    f"is not compiled into this build, which has only the program's own opcodes (vm.pack build_trims)")
        if code == abi.STATUS_BAD_OPCODE:
            known = ", ".join(f"{s.code}={s.name}" for s in abi.OPCODE_BY_CODE.values())
            return (f"megakernel trap: unknown opcode {opcode} in task {task} (instruction {detail}) on SM {sm}; "
                    f"known opcodes: {known}")
        if code == abi.STATUS_TIMEOUT and detail == PRELOAD_DETAIL:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} waited for its preloaded weight "
                    f"tile (bulk copy never completed)")
        if code == abi.STATUS_TIMEOUT and detail == FLAG_DETAIL:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} polled a data-flagged input "
                    f"(flag_hops) that never carried this launch's tag (its producer never wrote it)")
        stages = self.ring_bytes // max(1, int(self.build_info.get("stage_bytes", 1))) if self.ring_bytes else 0
        if code == abi.STATUS_TIMEOUT and detail < 0 and stages and -1 - detail >= stages:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: the weight ring's producer, issuing {where}'s "
                    f"rows, waited for slot {-1 - detail - stages} to be released by the compute warps")
        if code == abi.STATUS_TIMEOUT and detail < 0:
            return (f"megakernel wait timeout after {self.timeout_s:g} s: {where} waited for weight-ring slot "
                    f"{-1 - detail} (its stage never issued by the producer, or its bulk copy never completed)")
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
        """n_steps greedy steps entirely on the device, one launch: its last block stores out_slot[0:n_steps] = the
        steps' next tokens, token = the last one and pos += n_steps (IO_ADVANCE)."""
        self._launch(IO_ADVANCE, out_slot=out_slot)

    def _launches(self, n_tokens: int) -> int:
        """Launches that make n_tokens tokens (n_steps each; the last one's extra tokens are dropped)."""
        return -(-int(n_tokens) // self.n_steps)

    def prepare_decode(self, chunk: int) -> bool:
        """Capture a CUDA graph of the launches that make ``chunk`` tokens (once per chunk size). False if capture
        is unsupported."""
        import torch
        if chunk in self._graphs:
            return self._graphs[chunk] is not None
        n, k = self.n_steps, self._launches(chunk)
        hist = torch.zeros(k * n, dtype=torch.int32, device=self.device)  # the graph writes its tokens here
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(g):
                for j in range(k):
                    self._step_device(hist[j * n:(j + 1) * n])
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
        Status is reset once here and is sticky across the steps (a failed step makes the rest exit at once).
        A multi-step program runs whole launches: with n_tokens not a multiple of n_steps the last launch's extra
        tokens are dropped, and the device state continues after them."""
        import torch
        n_run = self._launches(n_tokens) * self.n_steps
        if isinstance(start_pos, int) and self.max_seq and start_pos + n_run > self.max_seq:
            raise MegakernelError(f"decode: positions up to {start_pos + n_run - 1} exceed the KV cache "
                                  f"({self.max_seq} positions; {n_tokens} tokens in launches of {self.n_steps})")
        if first_token is not None:
            self._set(self.token, first_token)
        if start_pos is not None:
            self._set_pos(start_pos)
        self.reset_sync()   # status (sticky errors) and counters: a launch that failed unchecked left both
        out = torch.empty(n_run, dtype=torch.int32, device=self.device)
        entry = self._graphs.get(n_tokens) if use_graph else None
        if entry is not None:
            g, hist = entry
            g.replay()
            out.copy_(hist)
        else:
            for i in range(0, n_run, self.n_steps):
                self._step_device(out[i:i + self.n_steps])
        return out[:n_tokens]

    def decode(self, first_token: int, start_pos: int, n_tokens: int, chunk: int = 32,
               use_graph: bool = True) -> list[int]:
        """Greedy decode: feed first_token at start_pos, then each output back. One host sync per chunk (rounded
        up to whole launches of a multi-step program)."""
        if n_tokens <= 0:
            return []
        n_run = self._launches(n_tokens) * self.n_steps
        if self.max_seq and start_pos + n_run > self.max_seq:
            raise MegakernelError(f"decode: positions up to {start_pos + n_run - 1} exceed the KV cache "
                                  f"({self.max_seq} positions; {n_tokens} tokens in launches of {self.n_steps})")
        chunk = self._launches(max(1, chunk)) * self.n_steps
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


def io_steps(program: MegakernelProgram) -> int:
    """Decode steps per launch of a program: 1 + its IO_INPUT buffers 'pos@1', 'pos@2', ... (schedule/lower.py
    step_io), which must be numbered without a gap."""
    at = sorted(s for b in program.buffers if b.kind == BufferKind.IO_INPUT and (s := name_step(b.name, "pos")))
    if at != list(range(1, len(at) + 1)):
        raise MegakernelError(f"program's step positions {['pos@%d' % s for s in at]} are not pos@1 .. pos@{len(at)}")
    for s in range(1, len(at) + 1):
        for name in (step_name("logits", s), step_name("next_token", s)):
            if not any(b.name == name and b.kind == BufferKind.IO_OUTPUT for b in program.buffers):
                raise MegakernelError(f"program has pos@{s} but no IO output buffer {name!r}")
    return len(at) + 1


def roofline_us(weight_bytes: int, gbps: float = 3050.0) -> float:
    """Weight-streaming floor of one token in microseconds."""
    return weight_bytes / (gbps * 1e9) * 1e6 if gbps > 0 else math.inf
