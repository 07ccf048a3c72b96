"""ABI layout: the committed header is what vm/abi.py renders, a g++-compiled probe of the header reports the same
sizeof/offsetof as vm.abi.layout_table(), and check_layout() names the struct + field of any drift. CPU only."""
from __future__ import annotations

import copy
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from schedule.graph import load_model
from schedule.ir import get_target
from schedule.lower import lower
from vm import abi
from vm.pack import (AbiMismatchError, MegakernelError, arch_has_bulk_copy, check_layout, pack_instructions,
                       pack_queues, preload_buffer_bytes)
from vm.smem import smem_floats

CSRC = pathlib.Path(abi.__file__).parent / "csrc"


def test_header_matches_render():
    assert abi.HEADER_PATH.read_text() == abi.render_header(), "run `python -m vm.abi` to regenerate amk_abi.h"


def _probe(tmp_path) -> dict:
    exe = tmp_path / "probe"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{CSRC}", str(CSRC / "layout_probe.cpp"), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    out: dict = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        s, f, v = line.split()
        out.setdefault(s, {})[f] = int(v)
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not on PATH")
def test_probe_matches_layout_table(tmp_path):
    reported = _probe(tmp_path)
    assert reported == abi.layout_table()
    check_layout(reported, abi.layout_table())  # no raise


def test_check_layout_names_struct_and_field():
    exp = abi.layout_table()
    bad = copy.deepcopy(exp)
    bad["AmkInstr"]["buf"] += 4
    with pytest.raises(AbiMismatchError, match=r"AmkInstr\.buf"):
        check_layout(bad, exp)
    bad = copy.deepcopy(exp)
    bad["AmkBufDesc"]["sizeof"] = 32
    with pytest.raises(AbiMismatchError, match=r"AmkBufDesc\.sizeof"):
        check_layout(bad, exp)
    bad = copy.deepcopy(exp)
    del bad["AmkInstr"]["prefetch_bytes"]
    with pytest.raises(AbiMismatchError, match=r"AmkInstr\.prefetch_bytes"):
        check_layout(bad, exp)


def test_pack_toy_program():
    """Packing a lowered toy program: opcode codes, slot order, params, queues as instruction indices."""
    from schedule.graph import load_model
    from schedule.ir import TARGETS
    from schedule.lower import lower
    g = load_model("toy", dtype="bf16")
    prog = lower(g, TARGETS["h100"], {"num_sms": 8, "attn_splits": 2}, max_seq=32)
    ins = pack_instructions(prog)
    assert ins.dtype == abi.INSTR_DTYPE and len(ins) == len(prog.tasks)
    for i, t in enumerate(prog.tasks):
        spec = abi.OPCODES[t.op]
        assert ins[i]["op"] == spec.code and ins[i]["task_id"] == t.id
        assert list(ins[i]["buf"][:ins[i]["n_bufs"]]) == list(t.inputs) + list(t.outputs)
        for j, n in enumerate(spec.iparams):
            assert ins[i]["ip"][j] == int(t.params.get(n, 0))
        assert ins[i]["prefetch_bytes"].sum() == 0  # no device pointers -> no prefetch
    offs, items = pack_queues(prog)
    assert offs[-1] == len(items) == len(prog.tasks) and sorted(items.tolist()) == list(range(len(prog.tasks)))
    # the largest area is attention's two 32 KB KV stages plus small areas
    assert max(smem_floats(t, 512) for t in prog.tasks) * 4 < 2 * 32768 + 48 * 1024


def test_weight_ranges_and_stream_flags():
    """Exact weight byte ranges per task (two for gate/up), stream flags only where rows are 16-byte multiples."""
    from schedule.graph import ModelConfig, ModelGraph, load_model, random_weights
    from schedule.ir import TARGETS
    from schedule.lower import lower
    from schedule.ops import qkv_rows
    g = load_model("toy", dtype="bf16")
    prog = lower(g, TARGETS["h100"], {"num_sms": 4}, max_seq=16)
    base = {b.id: 0x10000000 * (b.id + 1) for b in prog.buffers}
    ins = pack_instructions(prog, base.__getitem__, stage_bytes=32768)
    for i, t in enumerate(prog.tasks):
        r = ins[i]
        if t.op == "GEMV_SILU_MUL":
            rows, K = t.params["row_count"], t.params["k"]
            assert list(r["prefetch_bytes"]) == [rows * K * 2] * 2
            assert r["prefetch_ptr"][0] == base[t.inputs[1]] + t.params["row_start"] * K * 2
            assert r["prefetch_ptr"][1] == base[t.inputs[2]] + t.params["row_start"] * K * 2
        if t.op in ("GEMV", "GEMV_SILU_MUL") or (t.op == "QKV_ROPE" and not t.params.get("pair_count")):
            assert r["flags"] & abi.INSTR_FLAG_STREAM, t.op
        elif t.op == "QKV_ROPE":   # a slice of RoPE pairs is two row ranges: register path, both prefetchable
            assert not r["flags"] & abi.INSTR_FLAG_STREAM
            (a0, a1), (b0, b1) = qkv_rows(t)
            K = t.params["k"]
            assert list(r["prefetch_bytes"]) == [(a1 - a0) * K * 2, (b1 - b0) * K * 2]
            assert r["prefetch_ptr"][1] == base[t.inputs[1]] + b0 * K * 2
        else:
            assert not r["flags"] & (abi.INSTR_FLAG_STREAM | abi.INSTR_FLAG_PRELOAD)
            assert t.op != "EMBED" or r["prefetch_bytes"].sum() == 0
    weight_flags = abi.INSTR_FLAG_STREAM | abi.INSTR_FLAG_PRELOAD   # (KV_AHEAD marks issuers of attention's KV)
    assert not (pack_instructions(prog, base.__getitem__, stage_bytes=0)["flags"] & weight_flags).any()
    odd = ModelConfig("llama", 101, 90, 70, 1, 3, 1, 10, 1e-5, 10000.0, None, False, max_position=64)
    go = ModelGraph("odd", odd, random_weights(odd, "bf16", 0), "bf16")
    po = lower(go, TARGETS["h100"], {"num_sms": 4}, max_seq=16)
    ins = pack_instructions(po, lambda b: 4096 * (b + 1), stage_bytes=32768)
    assert not (ins["flags"] & weight_flags).any()  # 180-byte rows: register path
    assert np.all(ins["n_bufs"] <= abi.MAX_BUFS)


@pytest.mark.parametrize("cap", [0, 512, 1000, 4096, 1 << 20])
def test_preload_flags_and_buffer(cap):
    """INSTR_FLAG_PRELOAD exactly on GEMV-family tasks whose whole tile (all ranges) fits the cap, never together
    with the ring's STREAM flag; the buffer is the largest flagged tile rounded up to 128 bytes."""
    from schedule.graph import load_model
    from schedule.ir import TARGETS
    from schedule.lower import lower
    g = load_model("toy", dtype="bf16")
    prog = lower(g, TARGETS["h100"], {"num_sms": 4, "gemv_rows": 4}, max_seq=16)
    base = {b.id: 0x10000000 * (b.id + 1) for b in prog.buffers}
    ins = pack_instructions(prog, base.__getitem__, preload_cap=cap)
    tiles = []
    for i, t in enumerate(prog.tasks):
        tile = int(ins[i]["prefetch_bytes"].sum())
        want = t.op in ("GEMV", "GEMV_SILU_MUL", "QKV_ROPE") and 0 < tile <= cap
        assert bool(ins[i]["flags"] & abi.INSTR_FLAG_PRELOAD) == want, (t.op, t.params, tile, cap)
        assert not ins[i]["flags"] & abi.INSTR_FLAG_STREAM
        if want:
            tiles.append(tile)
    assert preload_buffer_bytes(ins) == (-(-max(tiles) // 128) * 128 if tiles else 0)
    index = {t.id: i for i, t in enumerate(prog.tasks)}
    for q in prog.queues:   # every flagged task but the first is issued by exactly one task of its queue: the one
        #                     just before it, unless that is before the previous flagged task's end; -1 elsewhere
        pos = [j for j, tid in enumerate(q) if ins[index[tid]]["flags"] & abi.INSTR_FLAG_PRELOAD]
        want = {max(a + 1, b - 1): index[q[b]] for a, b in zip(pos, pos[1:])}
        assert {j: int(ins[index[tid]]["next_preload"]) for j, tid in enumerate(q)
                if ins[index[tid]]["next_preload"] >= 0} == want
        for a, b in zip(pos, pos[1:]):
            assert a < max(a + 1, b - 1) <= b
    if cap >= 1 << 20:   # every GEMV-family task of the toy fits 1 MB
        assert len(tiles) == sum(t.op in ("GEMV", "GEMV_SILU_MUL", "QKV_ROPE") for t in prog.tasks)
    if cap == 1000:      # some tiles fit, some do not: the cap really decides
        assert 0 < len(tiles) < sum(t.op in ("GEMV", "GEMV_SILU_MUL", "QKV_ROPE") for t in prog.tasks)
    # the ring wins where both could apply
    both = pack_instructions(prog, base.__getitem__, stage_bytes=32768, preload_cap=cap)
    assert not ((both["flags"] & abi.INSTR_FLAG_STREAM != 0) & (both["flags"] & abi.INSTR_FLAG_PRELOAD != 0)).any()


def test_preload_needs_bulk_copy_arch():
    assert arch_has_bulk_copy("sm_90a") and arch_has_bulk_copy("sm_100a") and arch_has_bulk_copy("sm_120")
    assert not arch_has_bulk_copy("sm_80") and not arch_has_bulk_copy("sm_89") and not arch_has_bulk_copy("gfx90a")


def test_vm_refuses_invalid_program():
    """validate() runs before anything touches a GPU; its report is in the error."""
    from schedule.graph import load_model
    from schedule.ir import TARGETS
    from schedule.lower import lower
    from vm.loader import MegakernelError, MegakernelVM
    g = load_model("toy", dtype="f32")
    prog = lower(g, TARGETS["h100"], {"num_sms": 4}, max_seq=16)
    next(t for t in prog.tasks if t.waits).waits[0].threshold += 1
    with pytest.raises(MegakernelError, match=r"rejected by validate"):
        MegakernelVM(prog, g.weights)


def test_builds_are_per_dtype_set():
    from vm import jit
    assert jit.dtype_mask(["bf16", "i32", "bf16"]) == 1 << abi.DTYPE_CODES["bf16"]
    assert jit.dtype_mask(["f32", "f16"]) == (1 << abi.DTYPE_CODES["f32"]) | (1 << abi.DTYPE_CODES["f16"])
    assert "-DAMK_DTYPES=2" in jit.spec_for(arch="sm_90a", dtypes=2).cuda_cflags()
    assert f"-DAMK_DTYPES={jit.ALL_DTYPES}" in jit.spec_for(arch="sm_90a").cuda_cflags()
    assert jit.spec_for(arch="sm_90a", dtypes=2).digest() != jit.spec_for(arch="sm_90a").digest()
    with pytest.raises(jit.BuildError, match="dtypes mask"):
        jit.BuildSpec(arch="sm_90a", tma=False, dtypes=8)
    # the early KV copies are compiled in only when asked (the loader asks for programs with early_kv hints)
    assert "-DAMK_ATTN_EARLY=0" in jit.spec_for(arch="sm_90a").cuda_cflags()
    assert "-DAMK_ATTN_EARLY=1" in jit.spec_for(arch="sm_90a", attn_early=True).cuda_cflags()
    assert jit.spec_for(arch="sm_90a", attn_early=True).digest() != jit.spec_for(arch="sm_90a").digest()


@pytest.mark.parametrize("model,cfg,ctx,ns,want", [
    ("llama-3.2-1b", {}, 512, 4, 4),                    # 4 splits at ctx 512: only the 4-split body
    ("llama-3.2-1b", {"attn_splits": 8}, 512, 8, 8),
    ("llama-3.2-1b", {}, 8192, 16, 16),                 # 16 splits at long context
    ("llama-3.2-1b", {"attn_splits": 32}, 8192, 32, 4),  # past 16 the merge loops: the smallest body
    ("llama-3.2-1b", {"attn_splits": 1}, 512, 0, 4),    # one split: no merge tasks at all
])
def test_merge_unroll_covers_the_programs_splits(model, cfg, ctx, ns, want):
    """The loader compiles the smallest ATTN_MERGE body that covers the program's splits (vm/pack.py
    merge_unroll_for), and the spec passes it to nvcc (an A/B's own -DAMK_MERGE_UNROLL wins)."""
    from vm import jit
    from vm.pack import merge_unroll_for
    prog = lower(load_model(model, dtype="bf16", device="meta"), get_target("h100"), cfg, max_seq=ctx + 64)
    merges = [int(t.params["n_splits"]) for t in prog.tasks if t.op == "ATTN_MERGE"]
    assert max(merges + [0]) == ns
    assert merge_unroll_for(prog) == want
    flags = jit.spec_for(arch="sm_90a", merge_unroll=want).cuda_cflags()
    assert f"-DAMK_MERGE_UNROLL={want}" in flags
    assert jit.spec_for(arch="sm_90a", merge_unroll=4).digest() != jit.spec_for(arch="sm_90a").digest()
    own = jit.BuildSpec(arch="sm_90a", tma=False, merge_unroll=4, extra_cuda_cflags=("-DAMK_MERGE_UNROLL=16",))
    assert [f for f in own.cuda_cflags() if "MERGE_UNROLL" in f] == ["-DAMK_MERGE_UNROLL=16"]
    with pytest.raises(jit.BuildError, match="merge_unroll 5"):
        jit.BuildSpec(arch="sm_90a", tma=False, merge_unroll=5)


@pytest.mark.parametrize("kb,frm,want", [
    (128, "both", [65536, 65536]),     # 64 KB of the gate rows and 64 KB of the up rows, from the tile's first row
    (128, "gate", [131072, 0]),        # gate rows only: the task has no second weight input
    (384, "gate", [262144, 131072]),   # the whole 256 KB gate tile (64 rows x 2048 bf16), then 128 KB of up rows
])
def test_l2_prefetch_instructions_carry_their_ranges(kb, frm, want):
    g = load_model("llama-3.2-1b", dtype="bf16", device="meta")
    prog = lower(g, get_target("h100"), {"mlp_prefetch_kb": kb, "mlp_prefetch_from": frm}, max_seq=64)
    base = 1 << 20
    ptr = lambda bid: base * (bid + 1)  # noqa: E731
    instrs = pack_instructions(prog, ptr)
    K = prog.meta["hidden"]
    n = 0
    for i, t in enumerate(prog.tasks):
        if t.op != "L2_PREFETCH":
            continue
        n += 1
        r = instrs[i]
        assert r["op"] == abi.OPCODES["L2_PREFETCH"].code and r["out_counter"] == -1
        assert [int(b) for b in r["prefetch_bytes"]] == want
        assert int(r["prefetch_ptr"][0]) == ptr(t.inputs[0]) + t.params["start_a"] * 2
        if want[1]:
            assert int(r["prefetch_ptr"][1]) == ptr(t.inputs[1]) + t.params["start_b"] * 2
        assert t.params["start_a"] % K == 0
    assert n == 16 * (8192 // 64)


def test_attention_stage_geometry_is_a_build_knob(monkeypatch):
    """AMK_ATTN_STAGES / AMK_ATTN_STAGE_BYTES reach the compile flags and the digest; bad geometry is refused."""
    from vm import jit
    from vm.smem import ATTN_STAGE_BYTES, ATTN_STAGES
    base = jit.spec_for(arch="sm_90a")
    assert (base.attn_stages, base.attn_stage_bytes) == (ATTN_STAGES, ATTN_STAGE_BYTES)   # loader mirror
    assert f"-DAMK_ATTN_STAGES={ATTN_STAGES}" in base.cuda_cflags()
    monkeypatch.setenv("AMK_ATTN_STAGES", "3")
    monkeypatch.setenv("AMK_ATTN_STAGE_BYTES", "16384")
    three = jit.spec_for(arch="sm_90a")
    assert {"-DAMK_ATTN_STAGES=3", "-DAMK_ATTN_STAGE_BYTES=16384"} <= set(three.cuda_cflags())
    assert three.digest() != base.digest()
    for bad in ({"attn_stages": 0}, {"attn_stages": 5}, {"attn_stage_bytes": 100}, {"attn_stage_bytes": 4104},
                {"attn_stage_bytes": 1 << 17}):
        with pytest.raises(jit.BuildError, match="attention stages"):
            jit.BuildSpec(arch="sm_90a", tma=False, **bad)


def test_pack_marks_the_kv_ahead_issuers():
    """early_kv 2 tasks: exactly the task before each in its queue gets INSTR_FLAG_KV_AHEAD (it issues the KV
    history, vm/csrc amk_kv_ahead), the hint is packed as 2, and a program whose early_kv 2 task has no weight tile
    before it is refused naming the task (the op would read stages nobody filled)."""
    from schedule.graph import load_model
    from schedule.ir import TARGETS
    from schedule.lower import lower
    g = load_model("toy", dtype="bf16")
    prog = lower(g, TARGETS["h100"], {"num_sms": 8, "attn_splits": 2, "sm_assignment": "list", "early_kv": "ahead"},
                 max_seq=32)
    ins = pack_instructions(prog)
    want = set()
    for q in prog.queues:
        for prev, cur in zip(q, q[1:]):
            if prog.tasks[cur].params.get("early_kv") == 2:
                want.add(prev)
                assert prog.tasks[prev].op in ("QKV_ROPE", "GEMV", "GEMV_SILU_MUL")
    flagged = {i for i in range(len(ins)) if ins[i]["flags"] & abi.INSTR_FLAG_KV_AHEAD}
    assert want and flagged == want
    ek = abi.OPCODES["ATTN_PARTIAL"].iparams.index("early_kv")
    assert {int(ins[i]["ip"][ek]) for i, t in enumerate(prog.tasks) if t.op == "ATTN_PARTIAL"} >= {2}
    bad = next(t for t in prog.tasks if t.params.get("early_kv") == 2)
    pos = next((q, j) for q in prog.queues for j, tid in enumerate(q) if tid == bad.id)
    pos[0].insert(0, pos[0].pop(pos[1]))   # now first in its queue: nobody issues its rows
    with pytest.raises(MegakernelError, match=f"task {bad.id} \\(ATTN_PARTIAL\\): early_kv 2 needs a weight tile"):
        pack_instructions(prog)


def test_ring_window_build_knob(monkeypatch):
    """The weight ring's copies in flight (AMK_RING_WINDOW, vm/csrc/stream.cuh) are a build knob: the spec passes
    them to nvcc, reads AMK_RING_WINDOW from the environment (the A/B scripts' ``ring_window`` build key), and
    refuses a window that is not below the stage count (a window of all stages is no window)."""
    from vm import jit
    for env in ("AMK_RING_WINDOW", "AMK_STAGES", "AMK_STAGE_BYTES"):
        monkeypatch.delenv(env, raising=False)
    base = jit.spec_for(arch="sm_90a", tma=True, stages=9, stage_bytes=16384)
    assert base.ring_window == 2 and "-DAMK_RING_WINDOW=2" in base.cuda_cflags()
    monkeypatch.setenv("AMK_RING_WINDOW", "3")
    three = jit.spec_for(arch="sm_90a", tma=True, stages=9, stage_bytes=16384)
    assert "-DAMK_RING_WINDOW=3" in three.cuda_cflags() and three.digest() != base.digest()
    for w in (0, 9, 12):
        with pytest.raises(jit.BuildError, match="ring_window"):
            jit.BuildSpec(arch="sm_90a", tma=True, stages=9, stage_bytes=16384, ring_window=w)
    assert jit.BuildSpec(arch="sm_90a", tma=True, stages=2, stage_bytes=16384, ring_window=1).ring_window == 1
    assert jit.BuildSpec(arch="sm_90a", tma=False, stages=1, ring_window=5)   # (no ring: the window is unused)


def test_ring_fit_and_the_shrink_note():
    """select_build's ring fitting, by hand: an H100's 232448 B opt-in, 2048 B reserved for static shared memory;
    next to an op area of 86016 B, 144384 B are left: 8 stages of 16 KB (the "9 stages" of the forty-fourth
    session's A/Bs), 4 of 32 KB; no stage of a full opt-in; never more than asked. The note names asked and fitted
    stages and says when no ring is left."""
    from vm.pack import STATIC_SMEM_RESERVE, fit_ring_stages, ring_shrink_note
    assert STATIC_SMEM_RESERVE == 2048
    assert fit_ring_stages(232448, 86016, 16384, 9) == 8
    assert fit_ring_stages(232448, 86016, 32768, 9) == 4
    assert fit_ring_stages(232448, 86016, 16384, 6) == 6
    assert fit_ring_stages(232448, 232448, 16384, 4) == 0
    note = ring_shrink_note(9, 8, 16384, 86016, 232448)
    assert note.startswith("weight ring: 9 stages of 16384 B asked, 8 fit next to the largest op area (86016 B)")
    assert "no ring" not in note
    assert "fewer than 2 fit, so the build has no ring" in ring_shrink_note(4, 1, 65536, 200000, 232448)


def _fake_h100(monkeypatch, optin: int = 232448):
    """select_build on a CPU machine: an sm_90a device with an H100's opt-in shared memory (no GPU touched)."""
    import contextlib
    import types

    import torch

    from vm import jit
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(shared_memory_per_block_optin=optin))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(jit, "device_arch", lambda index=0: "sm_90a")


def test_select_build_shrinks_the_ring_and_says_what_was_asked(monkeypatch):
    """9 x 32 KB do not fit next to the toy's op area in 232448 B: the build takes the stages that fit (the same
    count fit_ring_stages gives for its op area) and keeps what was asked; a ring_window the fewer stages cannot take
    is refused with both counts named, not as a bare window error."""
    import torch

    from vm.pack import fit_ring_stages, select_build
    _fake_h100(monkeypatch)
    for env in ("AMK_RING_WINDOW", "AMK_STAGE_BYTES", "AMK_NVCC_FLAGS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("AMK_STAGES", "9")
    monkeypatch.setenv("AMK_STAGE_BYTES", "32768")
    prog = lower(load_model("toy", dtype="bf16"), get_target("h100"), {"num_sms": 4}, max_seq=16)
    b = select_build(prog, torch.device("cuda", 0), 512, 2, tma=True)
    fit = fit_ring_stages(232448, b.op_smem, 32768, 9)
    assert 2 <= fit < 9 and b.spec.tma and b.spec.stages == fit and b.ring_requested == 9
    monkeypatch.setenv("AMK_RING_WINDOW", "8")
    with pytest.raises(MegakernelError, match=f"weight ring: 9 stages of 32768 B asked, {fit} fit .*ring_window 8"):
        select_build(prog, torch.device("cuda", 0), 512, 2, tma=True)
    monkeypatch.setenv("AMK_STAGES", "2")   # a ring that fits is taken as asked
    monkeypatch.delenv("AMK_RING_WINDOW")
    b2 = select_build(prog, torch.device("cuda", 0), 512, 2, tma=True)
    assert b2.spec.stages == 2 and b2.ring_requested == 2


def test_the_config_asks_for_the_ring(monkeypatch):
    """ring_stages > 0 selects the weight ring with the config's geometry (over the AMK_* environment the A/B
    scripts set); MegakernelVM's tma=False keeps it off; before sm_90 there is none; a window at or above the stages
    is refused by ScheduleConfig naming ring_window."""
    import torch

    from schedule.ir import IRError, ScheduleConfig
    from vm import jit
    from vm.pack import select_build
    _fake_h100(monkeypatch)
    for env in ("AMK_TMA", "AMK_STAGES", "AMK_STAGE_BYTES", "AMK_RING_WINDOW", "AMK_NVCC_FLAGS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("AMK_STAGES", "9")   # (the config's ring wins over these)
    monkeypatch.setenv("AMK_RING_WINDOW", "1")
    g = load_model("toy", dtype="bf16")
    dev = torch.device("cuda", 0)
    cfg = {"num_sms": 4, "ring_stages": 4, "ring_stage_kb": 16, "ring_window": 3}
    b = select_build(lower(g, get_target("h100"), cfg, max_seq=16), dev, 512, 2)
    assert (b.spec.tma, b.spec.stages, b.spec.stage_bytes, b.spec.ring_window) == (True, 4, 16384, 3)
    assert "-DAMK_STAGES=4" in b.spec.cuda_cflags() and "-DAMK_RING_WINDOW=3" in b.spec.cuda_cflags()
    auto = select_build(lower(g, get_target("h100"), {**cfg, "ring_window": 0}, max_seq=16), dev, 512, 2)
    assert auto.spec.ring_window == 1   # 0 = auto: the environment's, else 2
    monkeypatch.delenv("AMK_RING_WINDOW")
    auto = select_build(lower(g, get_target("h100"), {**cfg, "ring_window": 0}, max_seq=16), dev, 512, 2)
    assert auto.spec.ring_window == 2
    off = select_build(lower(g, get_target("h100"), cfg, max_seq=16), dev, 512, 2, tma=False)
    assert not off.spec.tma and off.ring_requested == 0
    none = select_build(lower(g, get_target("h100"), {"num_sms": 4}, max_seq=16), dev, 512, 2)
    assert not none.spec.tma   # no ring asked, AMK_TMA unset
    monkeypatch.setattr(jit, "device_arch", lambda index=0: "sm_80")
    assert not select_build(lower(g, get_target("h100"), cfg, max_seq=16), dev, 512, 2).spec.tma
    with pytest.raises(IRError, match="ring_window: 4 copies in flight must be below ring_stages 4"):
        ScheduleConfig(ring_stages=4, ring_window=4)
    assert ScheduleConfig(ring_window=11).ring_window == 11   # (no ring: the window is unused)
    flags = jit.build_flags(cfg)
    assert "-DAMK_TMA=1" in flags and "-DAMK_STAGE_BYTES=16384" in flags
    assert "-DAMK_TMA=0" in jit.build_flags({})


def test_a_shrunk_ring_keeps_an_asked_window_and_fits_the_auto_one(monkeypatch):
    """Room for only 2 stages (64 KB stages next to the toy's 75 KB op area in a faked 210 KB opt-in): the auto window
    (2 copies) follows the ring down to 1; a window the config asks for is kept, so 2 is refused naming both."""
    import torch

    from vm.pack import fit_ring_stages, select_build
    _fake_h100(monkeypatch, optin=210 * 1024)
    for env in ("AMK_TMA", "AMK_STAGES", "AMK_STAGE_BYTES", "AMK_RING_WINDOW", "AMK_NVCC_FLAGS"):
        monkeypatch.delenv(env, raising=False)
    g = load_model("toy", dtype="bf16")
    dev = torch.device("cuda", 0)
    cfg = {"num_sms": 4, "ring_stages": 4, "ring_stage_kb": 64}
    b = select_build(lower(g, get_target("h100"), cfg, max_seq=16), dev, 512, 2)
    assert fit_ring_stages(210 * 1024, b.op_smem, 65536, 4) == 2
    assert (b.spec.stages, b.spec.ring_window, b.ring_requested) == (2, 1, 4)
    with pytest.raises(MegakernelError, match="4 stages of 65536 B asked, 2 fit .*ring_window 2"):
        select_build(lower(g, get_target("h100"), {**cfg, "ring_window": 2}, max_seq=16), dev, 512, 2)
