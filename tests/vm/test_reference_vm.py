"""Reference VM vs Hugging Face transformers eager (fp32, same random weights) for every supported family at odd
sizes: max relative logit error <= 1e-4 over 10 decode steps and identical greedy tokens for 16 tokens, under
several schedule configs and random legal execution orders."""
from __future__ import annotations

import pytest
import torch

from eval.equivalence import greedy_decode, hf_greedy, verify_steps
from schedule.ir import TARGETS
from schedule.lower import lower
from tests.conftest import SMALL_CONFIGS, small_graph
from vm.reference_vm import ReferenceVM, VMError

CONFIGS = [{}, {"attn_splits": 3, "qkv_heads": 2, "gemv_rows": 8, "sm_assignment": "lpt", "num_sms": 7},
           {"fuse_norm": False, "fuse_residual": False, "mlp_rows": 64, "sm_assignment": "round_robin",
            "num_sms": 5},
           {"attn_splits": 4, "fuse_attn_merge": True, "num_sms": 6},   # o_proj merges the partials
           {"attn_splits": 2, "o_proj_by_group": True, "num_sms": 6},   # o_proj per KV group, adding into x
           {"fuse_down": True, "mlp_rows": 8, "num_sms": 5},   # MLP tiles adding their down share into x_{l+1}
           {"dyn_mlp_rows": 4, "num_sms": 7},   # gate/up as claim groups: rows split among members at run time
           # QK-norm models: the attention tasks finish the RAW q rows, the last split / ATTN_DECODE the K row
           {"qkv_head_split": 2, "attn_splits": 3, "fold_qk_norm": True, "num_sms": 7},
           {"qkv_head_split": 4, "attn_splits": 1, "fold_qk_norm": True, "num_sms": 6}]


@pytest.mark.parametrize("family", sorted(SMALL_CONFIGS))
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_reference_vm_matches_transformers(family, ci):
    g = small_graph(family, seed=11 + ci)
    prog = lower(g, TARGETS["h100"], CONFIGS[ci], max_seq=40)
    vm = ReferenceVM(prog, g.weights, seed=ci)
    toks = torch.randint(0, g.config.vocab, (10,), generator=torch.Generator().manual_seed(ci)).tolist()
    res = verify_steps(vm.step, g.hf_model(), toks, "f32")
    assert res["max_rel_err"] <= 1e-4, res
    assert res["top1_agreement"] == 1.0


@pytest.mark.parametrize("family", sorted(SMALL_CONFIGS))
def test_greedy_16_tokens_identical(family):
    g = small_graph(family, seed=5)
    prog = lower(g, TARGETS["h100"], {"attn_splits": 2}, max_seq=32)
    vm = ReferenceVM(prog, g.weights, seed=3)
    prompt = [7, 100, 250, 3]
    assert greedy_decode(vm.step, prompt, 16) == hf_greedy(g.hf_model(), prompt, 16)


def test_random_orders_agree_bitwise():
    """Different legal interleavings compute the same function (each task is deterministic)."""
    g = small_graph("llama-untied", seed=2)
    prog = lower(g, TARGETS["h100"], {"num_sms": 9}, max_seq=8)
    outs, traces = [], []
    for seed in range(3):
        vm = ReferenceVM(prog, g.weights, seed=seed)
        outs.append(vm.step(42, 0))
        traces.append(tuple(vm.trace))
    assert len(set(traces)) == 3, "seeds should produce different legal orders"
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_kv_cache_persists_and_bf16_rounding():
    g = small_graph("qwen3", seed=9, dtype="bf16")
    prog = lower(g, TARGETS["h100"], {}, max_seq=8)
    vm = ReferenceVM(prog, g.weights)
    kc = vm.mem[prog.buffer("k_cache0").id]
    assert kc.dtype == torch.bfloat16
    vm.step(1, 0)
    row0 = kc[:, 0].clone()
    assert row0.abs().sum() > 0
    vm.step(2, 1)
    assert torch.equal(kc[:, 0], row0) and kc[:, 1].abs().sum() > 0
    vm.reset()
    assert kc.abs().sum() == 0


def test_bad_token_and_position_are_clear_errors():
    g = small_graph("llama-untied")
    vm = ReferenceVM(lower(g, TARGETS["h100"], {}, max_seq=4), g.weights)
    with pytest.raises(VMError, match="token id 313 outside"):
        vm.step(313, 0)
    with pytest.raises(VMError, match="position 4 outside the KV cache"):
        vm.step(1, 4)


def test_missing_and_misshapen_weights():
    g = small_graph("llama-untied")
    prog = lower(g, TARGETS["h100"], {}, max_seq=4)
    w = dict(g.weights)
    w.pop("model.norm.weight")
    with pytest.raises(VMError, match="weight 'model.norm.weight' is missing"):
        ReferenceVM(prog, w)
    w["model.norm.weight"] = torch.ones(3)
    with pytest.raises(VMError, match=r"has shape \(3,\), program expects \(96,\)"):
        ReferenceVM(prog, w)


@pytest.mark.parametrize("family", sorted(SMALL_CONFIGS))
def test_attn_merge_in_o_proj_matches_merge_tasks(family):
    """fuse_attn_merge (o_proj merges the split-KV partials) computes exactly what ATTN_MERGE tasks + o_proj do."""
    g = small_graph(family, seed=8)
    out = []
    for fuse in (True, False):
        prog = lower(g, TARGETS["h100"], {"attn_splits": 3, "fuse_attn_merge": fuse}, max_seq=40)
        assert any(t.op == "ATTN_MERGE" for t in prog.tasks) != fuse
        vm = ReferenceVM(prog, g.weights, seed=1)
        out.append(torch.stack([vm.step(5 + i, 3 * i).clone() for i in range(5)]))
    assert torch.isfinite(out[0]).all()
    assert torch.equal(out[0], out[1])


class _Mem:
    """The slice of a VM the argmax ops touch: buffers by id."""
    def __init__(self, bufs):
        self.bufs = bufs

    def buf(self, bid):
        return self.bufs[bid]


def _split_argmax(logits: torch.Tensor, bounds: list[int]) -> int:
    """ARGMAX_PARTIAL per range [bounds[k], bounds[k+1]), then ARGMAX_MERGE, on the reference ops directly."""
    from schedule.ir import Task
    from vm.reference_vm import REFERENCE
    n_cand = len(bounds) - 1
    mem = _Mem({0: logits, 1: torch.full((n_cand,), -7, dtype=torch.int32), 2: torch.zeros(1, dtype=torch.int32)})
    for k in range(n_cand):
        REFERENCE["ARGMAX_PARTIAL"](mem, Task(k, "ARGMAX_PARTIAL", [0], [1], params={
            "start": bounds[k], "count": bounds[k + 1] - bounds[k], "slot": k}))
    REFERENCE["ARGMAX_MERGE"](mem, Task(n_cand, "ARGMAX_MERGE", [0, 1], [2],
                                        params={"n": len(logits), "n_cand": n_cand}))
    return int(mem.buf(2)[0])


@pytest.mark.parametrize("bounds", [[0, 313], [0, 64, 128, 192, 256, 313], [0, 1, 2, 100, 101, 313],
                                    [0, 157, 313]])
def test_split_argmax_is_torch_argmax(bounds):
    """The split argmax picks what torch.argmax picks (first index on ties) for random logits, ties inside a range
    and across ranges, and the first NaN (NaN counts as the maximum); hand-checked indices, 313 logits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(313, generator=g)
    assert _split_argmax(x, bounds) == int(torch.argmax(x))
    x[[70, 71, 200]] = x.max() + 1.0          # ties inside one range and across ranges: the first wins
    assert _split_argmax(x, bounds) == 70 == int(torch.argmax(x))
    x[[250, 150, 300]] = float("nan")          # NaN is the maximum; the first NaN wins
    assert _split_argmax(x, bounds) == 150
    x = torch.full((313,), -3.5)               # all equal: index 0
    assert _split_argmax(x, bounds) == 0 == int(torch.argmax(x))


def _pairs_argmax(logits: torch.Tensor, bounds: list[int]) -> int:
    """An LM-head GEMV tile per range [bounds[k], bounds[k+1]) with has_argmax (W = diag(logits), x = ones: its
    rows are the logits themselves, a NaN only in its own row), then ARGMAX_PAIRS, on the reference ops directly."""
    from schedule.ir import Task
    from vm.reference_vm import REFERENCE
    n, n_cand = len(logits), len(bounds) - 1
    mem = _Mem({0: torch.ones(n), 1: torch.diag(logits), 2: torch.zeros(n), 3: torch.full((2 * n_cand,), -7.0),
                4: torch.zeros(1, dtype=torch.int32)})
    for k in range(n_cand):
        REFERENCE["GEMV"](mem, Task(k, "GEMV", [0, 1], [2, 3], params={
            "row_start": bounds[k], "row_count": bounds[k + 1] - bounds[k], "k": n, "n": n, "has_norm": 0,
            "has_bias": 0, "has_residual": 0, "has_argmax": 1, "argmax_slot": k}))
    nan = torch.isnan(logits)
    assert torch.equal(mem.buf(2)[~nan], logits[~nan]) and bool(mem.buf(2)[nan].isnan().all())  # the rows as well
    REFERENCE["ARGMAX_PAIRS"](mem, Task(n_cand, "ARGMAX_PAIRS", [3], [4], params={"n_cand": n_cand}))
    return int(mem.buf(4)[0])


@pytest.mark.parametrize("bounds", [[0, 313], [0, 64, 128, 192, 256, 313], [0, 1, 2, 100, 101, 313],
                                    [0, 157, 313]])
def test_argmax_pairs_of_lm_head_tiles_is_torch_argmax(bounds):
    """The argmax from the tiles' own (max, index) pairs picks what torch.argmax picks: random logits, ties inside
    a tile and across tiles, the first NaN, all equal (the cases of the split argmax above)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(313, generator=g)
    assert _pairs_argmax(x, bounds) == int(torch.argmax(x))
    x[[70, 71, 200]] = x.max() + 1.0
    assert _pairs_argmax(x, bounds) == 70 == int(torch.argmax(x))
    x[[250, 150, 300]] = float("nan")
    assert _pairs_argmax(x, bounds) == 150
    x = torch.full((313,), -3.5)
    assert _pairs_argmax(x, bounds) == 0 == int(torch.argmax(x))


def test_argmax_merge_rejects_a_candidate_outside_the_logits():
    from schedule.ir import Task
    from vm.reference_vm import REFERENCE
    mem = _Mem({0: torch.randn(10), 1: torch.tensor([3, 12], dtype=torch.int32), 2: torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(VMError, match=r"outside \[0, 10\)"):
        REFERENCE["ARGMAX_MERGE"](mem, Task(0, "ARGMAX_MERGE", [0, 1], [2], params={"n": 10, "n_cand": 2}, label="m"))


def test_column_sliced_weights_come_back_whole():
    """o_proj_by_group stores W_o as one column block per KV group (Buffer.cols); weight_tensors() (what the HF
    comparisons load) puts the blocks back together into the state-dict tensor."""
    g = small_graph("llama-untied", seed=4)
    prog = lower(g, TARGETS["h100"], {"o_proj_by_group": True}, max_seq=16)
    key = "model.layers.0.self_attn.o_proj.weight"
    blocks = [b for b in prog.buffers if b.source == key]
    assert len(blocks) == g.config.n_kv_heads and all(b.cols is not None for b in blocks)
    vm = ReferenceVM(prog, g.weights)
    assert torch.equal(vm.weight_tensors()[key], g.weights[key].float())
    bad = dict(g.weights)
    bad[key] = g.weights[key][:, :8]
    with pytest.raises(VMError, match=r"columns \[\d+, \d+\) of weight"):
        ReferenceVM(prog, bad)
