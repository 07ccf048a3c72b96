"""Roofline floor of a decode step: every weight byte plus the KV bytes at the context length, over bandwidth."""
from __future__ import annotations

from schedule.ir import GpuTarget, MegakernelProgram


def roofline(program: MegakernelProgram, target: GpuTarget | None = None, ctx: int = 512,
             bandwidth_gbps: float | None = None) -> dict:
    """{weight_bytes, kv_bytes, total_bytes, bandwidth_gbps, floor_us} for one token at context ``ctx``."""
    t = target or program.target
    bw = float(bandwidth_gbps or t.hbm_gbps)
    wb = program.weight_bytes
    kv = int(program.meta.get("kv_bytes_per_token", 0)) * int(ctx)
    total = wb + kv
    return {"weight_bytes": wb, "kv_bytes": kv, "total_bytes": total, "bandwidth_gbps": bw, "ctx": ctx,
            "floor_us": total / (bw * 1e9) * 1e6}


def pct_of_roofline(latency_us: float, floor_us: float) -> float:
    return 100.0 * floor_us / latency_us if latency_us > 0 else 0.0
