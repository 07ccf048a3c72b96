"""Peer baselines for the benchmark: the same decode step written in plain torch (static KV cache, batch 1), run
as torch eager, replayed as one CUDA graph, and torch.compile'd + CUDA graph. Also HBM read/copy bandwidth.

The torch step mirrors the HF modeling code (Llama / Qwen2 / Qwen3 / Mistral) in the model dtype; it reads the same
weight tensors the megakernel reads, so the comparison is bytes-for-bytes.
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from schedule.graph import ModelGraph, lm_head_key, rope_inv_freq


class TorchDecoder:
    """A static-shape decode step: step(token[1] int64 cuda, pos[1] int64 cuda) -> logits [vocab] fp32."""

    def __init__(self, graph: ModelGraph, max_seq: int, device: str = "cuda"):
        c = graph.config
        self.c, self.S = c, max_seq
        dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[graph.dtype]
        self.dt = dt
        self.w = {k: v.to(device=device, dtype=dt) for k, v in graph.weights.items()}
        self.lm = self.w[lm_head_key(c)]
        self.inv_freq = rope_inv_freq(c).to(device)
        self.k = [torch.zeros(c.n_kv_heads, max_seq, c.head_dim, device=device, dtype=dt) for _ in range(c.n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.ar = torch.arange(max_seq, device=device)

    def _norm(self, x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(self.dt) * w

    def _rope(self, x, pos):  # x: [h, hd]
        ang = pos.float() * self.inv_freq                      # [hd/2]
        cos, sin = torch.cat([ang.cos(), ang.cos()]).to(self.dt), torch.cat([ang.sin(), ang.sin()]).to(self.dt)
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, w, hd = self.c, self.w, self.c.head_dim
        x = w["model.embed_tokens.weight"][token]              # [1, H]
        L = pos + 1
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"], c.rms_eps)
            q, k, v = (F.linear(h, w[p + f"self_attn.{m}_proj.weight"], w.get(p + f"self_attn.{m}_proj.bias"))
                       for m in "qkv")
            q, k, v = q.view(c.n_heads, hd), k.view(c.n_kv_heads, hd), v.view(c.n_kv_heads, hd)
            if c.qk_norm:
                q = self._norm(q, w[p + "self_attn.q_norm.weight"], c.rms_eps)
                k = self._norm(k, w[p + "self_attn.k_norm.weight"], c.rms_eps)
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k[i].index_copy_(1, pos, k[:, None])
            self.v[i].index_copy_(1, pos, v[:, None])
            kk = self.k[i].repeat_interleave(c.group, 0)        # [nh, S, hd]
            vv = self.v[i].repeat_interleave(c.group, 0)
            s = (q[:, None, :] @ kk.transpose(1, 2)).float() * hd ** -0.5   # [nh, 1, S]
            mask = self.ar >= L
            if c.sliding_window:
                mask = mask | (self.ar < L - c.sliding_window)
            s = s.masked_fill(mask, float("-inf"))
            o = (torch.softmax(s, -1).to(self.dt) @ vv).view(1, -1)
            x = x + F.linear(o, w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, w[p + "post_attention_layernorm.weight"], c.rms_eps)
            g = F.linear(h, w[p + "mlp.gate_proj.weight"])
            u = F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(g) * u, w[p + "mlp.down_proj.weight"])
        return F.linear(self._norm(x, w["model.norm.weight"], c.rms_eps), self.lm).float()[0]


def cuda_time_us(fn: Callable[[], object], iters: int = 20, repeats: int = 5, warmup: int = 3) -> dict:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) * 1e3 / iters)
    return {"us": statistics.median(res), "min_us": min(res), "max_us": max(res), "repeats": res}


def capture_graph(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture ``fn`` (static shapes, device-side state only) into a CUDA graph; returns replay()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def hbm_bandwidth(gib: float = 4.0) -> dict:
    """Measured HBM read (a sum over a large buffer) and copy bandwidth, GB/s (bytes read (+ written) / time)."""
    n = int(gib * 2**30) // 4
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    out = torch.empty((), device="cuda")
    rd = cuda_time_us(lambda: torch.sum(src, dim=0, out=out), iters=5, repeats=5)
    cp = cuda_time_us(lambda: dst.copy_(src), iters=5, repeats=5)
    nbytes = n * 4
    res = {"read_gbps": nbytes / rd["us"] / 1e3, "copy_gbps": 2 * nbytes / cp["us"] / 1e3}
    del src, dst
    torch.cuda.empty_cache()
    return res


def torch_baselines(graph: ModelGraph, ctx: int, max_seq: int, compile_mode: str | None = "max-autotune-no-cudagraphs",
                    iters: int = 20) -> dict:
    """us/token of the torch step: eager, one CUDA graph, torch.compile + CUDA graph (None if it fails)."""
    dec = TorchDecoder(graph, max_seq)
    tok = torch.tensor([1], device="cuda")
    pos = torch.tensor([ctx], device="cuda")
    out: dict = {}
    with torch.no_grad():
        out["torch_eager"] = cuda_time_us(lambda: dec.step(tok, pos), iters=max(3, iters // 4))["us"]
        out["torch_cuda_graph"] = cuda_time_us(capture_graph(lambda: dec.step(tok, pos)), iters=iters)["us"]
        if compile_mode:
            try:
                cstep = torch.compile(dec.step, mode=compile_mode, fullgraph=True, dynamic=False)
                out["torch_compile_cuda_graph"] = cuda_time_us(capture_graph(lambda: cstep(tok, pos)),
                                                               iters=iters)["us"]
            except Exception as e:  # report, don't crash the table
                out["torch_compile_cuda_graph"] = None
                out["torch_compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["logits_check"] = dec.step(tok, torch.tensor([0], device="cuda"))
    return out
