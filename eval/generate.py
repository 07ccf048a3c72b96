"""GPU generate with the numbers a user asks for: prefill token by token through the megakernel, then greedy decode in
CUDA-graph chunks (whole launches of a multi-step program) with **no host sync inside a chunk** (checked with
``torch.cuda.set_sync_debug_mode("error")``), tokens read back once per chunk (streamed to ``on_chunk``), decode time from CUDA events.

    stats = gpu_generate(vm, prompt, n_new, chunk=32, on_chunk=print)
    stats["tokens"], stats["decode_us_per_token"], stats["sync_check"]
"""
from __future__ import annotations

import time
from typing import Callable


def gpu_generate(vm, prompt: list[int], n_new: int, chunk: int = 32, sync_check: bool = True,
                 on_chunk: Callable[[list[int]], None] | None = None) -> dict:
    """Greedy-generate ``n_new`` tokens after ``prompt`` on a MegakernelVM -> stats dict (see module doc)."""
    import torch
    from vm.loader import MegakernelError
    if not prompt:
        raise MegakernelError("generate: empty prompt")
    per = int(getattr(vm, "n_steps", 1))   # a multi-step program decodes in whole launches of this many tokens
    need = len(prompt) - 1 + -(-n_new // per) * per
    if vm.max_seq and max(len(prompt) + n_new, need) > vm.max_seq:
        raise MegakernelError(f"generate: {len(prompt)} prompt + {n_new} new tokens exceed the KV cache "
                              f"({vm.max_seq} positions{f'; launches of {per} steps' if per > 1 else ''})")
    t0 = time.perf_counter()
    for i, t in enumerate(prompt[:-1]):       # prefill: token by token through the megakernel
        vm.step(int(t), i, check=False)
    vm.check_status()
    prefill_s = time.perf_counter() - t0
    chunk = max(1, min(chunk, n_new))
    chunk = -(-chunk // per) * per   # whole launches: a chunk's dropped tokens would be skipped by the next chunk
    t1 = time.perf_counter()
    graphs = vm.prepare_decode(chunk)         # capture once (outside the sync-checked region)
    if n_new % chunk:
        vm.prepare_decode(n_new % chunk)
    capture_s = time.perf_counter() - t1
    tokens: list[int] = []
    ev: list[tuple] = []
    syncs_checked = 0
    first = True
    while len(tokens) < n_new:
        k = min(chunk, n_new - len(tokens))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sync_check:
            torch.cuda.set_sync_debug_mode("error")   # any host sync in here raises
        try:
            a.record()
            out = vm.decode_device(k, int(prompt[-1]) if first else None, len(prompt) - 1 if first else None)
            b.record()
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode("default")
        syncs_checked += k if sync_check else 0
        first = False
        new = out.tolist()                    # the one host sync of this chunk
        vm.check_status()
        ev.append((a, b, k))
        tokens += new
        if on_chunk is not None:
            on_chunk(new)
    decode_ms = sum(a.elapsed_time(b) for a, b, _ in ev)
    return {"tokens": tokens, "prefill_tokens": len(prompt) - 1, "prefill_s": round(prefill_s, 4),
            "capture_s": round(capture_s, 3), "cuda_graphs": bool(graphs), "chunk": chunk, "chunks": len(ev),
            "decode_ms": round(decode_ms, 3), "decode_us_per_token": round(decode_ms * 1e3 / max(1, n_new), 1),
            "tokens_per_s": round(n_new / (decode_ms / 1e3), 1) if decode_ms > 0 else None,
            "sync_check": (f"passed: 0 host syncs in {syncs_checked} decode steps "
                           f"(torch.cuda.set_sync_debug_mode('error'); one read-back per {chunk}-token chunk)")
            if sync_check else "off"}
