"""Multi-step launches on the GPU (knob steps_per_launch): one launch runs N greedy decode steps, step s+1's
embedding reading step s's argmax on the device at position pos + s + 1.

References outside the code under test: the ReferenceVM running N one-step programs one after another (fp32), and
the one-step GPU program decoding the same tokens. All tests carry @pytest.mark.cuda.
"""
from __future__ import annotations

import pytest
import torch

from schedule.ir import TARGETS
from schedule.lower import lower
from tests.schedule.test_steps import _chain
from tests.vm.test_megakernel_gpu import CONFIGS, graph, rel_err

pytestmark = pytest.mark.cuda


def _programs(name: str, dtype: str, cfg: str, n: int, max_seq: int = 64, **extra):
    g = graph(name, dtype)
    one = lower(g, TARGETS["h100"], {**CONFIGS[cfg], **extra}, max_seq=max_seq)
    many = lower(g, TARGETS["h100"], {**CONFIGS[cfg], **extra, "steps_per_launch": n}, max_seq=max_seq)
    return g, one, many


# the token hand-over: the next EMBED waits on ARGMAX_PAIRS (default), on ARGMAX_MERGE (argmax_in_lm_head off) or
# on one ARGMAX (split_argmax off)
@pytest.mark.parametrize("name,dtype,cfg,n,extra", [
    ("llama-untied", "f32", "default", 3, {}), ("qwen3", "f32", "split", 2, {}),
    ("llama-tied-rope3", "bf16", "lpt", 4, {}), ("llama-untied", "f32", "default", 2, {"argmax_in_lm_head": False}),
    ("qwen3", "f32", "default", 3, {"split_argmax": False}),
    ("llama-untied", "f32", "default", 3, {"step_placement": "replicate"}),   # each step on step 0's SMs
    ("qwen3", "bf16", "split", 2, {"step_placement": "replicate"})])
def test_steps_match_one_step_chain(name, dtype, cfg, n, extra):
    from vm.loader import MegakernelVM
    g, one, many = _programs(name, dtype, cfg, n, **extra)
    vm = MegakernelVM(many, g.weights)
    assert vm.n_steps == n
    pos = 5
    for i in range(pos):
        vm.step(7 + i, i)
    vm.step(11, pos)
    want_logits, want_toks = _chain(one, g, 11, pos, n, history=True)
    tol = 1e-5 if dtype == "f32" else 2e-2
    for s in range(n):
        assert rel_err(vm.step_logits[s], want_logits[s]) <= tol, f"step {s}"
    assert vm.tokens_all.tolist() == want_toks
    assert int(vm.pos_all[0].item()) == pos and vm.pos_all.tolist() == [pos + s for s in range(n)]


@pytest.mark.parametrize("use_graph", [False, True])
def test_steps_decode_equals_one_step_decode(use_graph):
    from vm.loader import MegakernelVM
    g, one, many = _programs("qwen3", "f32", "default", 4)
    a, b = MegakernelVM(one, g.weights), MegakernelVM(many, g.weights)
    want = a.decode(9, 0, 14, chunk=8, use_graph=use_graph)
    got = b.decode(9, 0, 14, chunk=8, use_graph=use_graph)   # chunks of 8 = 2 launches; 14 = 4 launches, 2 dropped
    assert got == want
    # device state continues after the whole launches: pos 16, token = the 16th output
    assert int(b.pos_all[0].item()) == 16
    more = b.decode_device(4).tolist()
    b.check_status()
    ref = a.decode(9, 0, 20, chunk=20, use_graph=False)
    assert more == ref[16:20]


def test_steps_decode_refuses_positions_past_the_cache():
    from vm.loader import MegakernelError, MegakernelVM
    g, _, many = _programs("llama-untied", "f32", "default", 4, max_seq=16)
    vm = MegakernelVM(many, g.weights)
    with pytest.raises(MegakernelError, match="exceed the KV cache"):
        vm.decode(3, 10, 5)   # 2 launches: positions 10..17
    vm.step(3, 12)   # positions 12..15 fit
    with pytest.raises(MegakernelError, match="position 16 outside the KV cache"):
        vm.step(3, 13)   # its last step would append row 16
    vm.step(3, 0)   # the next launch works
    assert torch.isfinite(vm.step_logits[-1]).all()


def test_gpu_generate_decodes_whole_launches():
    """eval.generate.gpu_generate with 4 steps per launch: a 5-token chunk becomes 8 (whole launches; a chunk's
    dropped tokens would be skipped by the next chunk), 13 new tokens equal the one-step program's."""
    from eval.generate import gpu_generate
    from vm.loader import MegakernelVM
    g, one, many = _programs("qwen3", "f32", "default", 4)
    want = MegakernelVM(one, g.weights).generate([4, 8, 15], 13, chunk=5)
    st = gpu_generate(MegakernelVM(many, g.weights), [4, 8, 15], 13, chunk=5)
    assert st["tokens"] == want and st["chunk"] == 8 and st["chunks"] == 2
