"""Model import: presets have exact public shapes; HF checkpoint dirs (single and sharded) and model objects
import with identical weights; bad input gives a GraphError naming the problem."""
from __future__ import annotations

import json

import pytest
import torch

from schedule.graph import (PRESETS, GraphError, config_from_hf, from_checkpoint, load_model, rope_inv_freq,
                            weight_shapes)
from tests.conftest import small_graph


def test_llama_1b_preset_bytes_match_public_model():
    g = load_model("llama-3.2-1b", dtype="bf16")
    assert g.weight_bytes == 2_471_628_800          # 1,235,814,400 params (tied) x 2 bytes
    assert g._weights is None                         # lazily materialized: shapes alone give the bytes


@pytest.mark.parametrize("name,params", [("llama-3.2-3b", 3_212_749_824), ("llama-3.1-8b", 8_030_261_248),
                                         ("qwen3-0.6b", 596_049_920), ("qwen3-1.7b", 1_720_574_976)])
def test_preset_parameter_counts(name, params):
    c = PRESETS[name]
    import math
    assert sum(math.prod(s) for s in weight_shapes(c).values()) == params


def test_rope_inv_freq_matches_transformers_llama3():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    c = PRESETS["llama-3.2-1b"]
    inv_hf, _ = ROPE_INIT_FUNCTIONS["llama3"](c.to_hf(), "cpu")
    assert torch.allclose(rope_inv_freq(c), inv_hf.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_dir_roundtrip(tmp_path, sharded):
    g = small_graph("qwen3", seed=3)
    model = g.hf_model()
    model.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    g2 = from_checkpoint(tmp_path)
    assert g2.config.arch == "qwen3" and g2.config.qk_norm and g2.config.tie_embeddings
    assert set(g2.weights) == set(g.weights)
    for k in g.weights:
        assert torch.equal(g2.weights[k], g.weights[k]), k


def test_from_model_object():
    g = small_graph("qwen2", seed=4)
    g2 = load_model(g.hf_model())
    assert g2.config.attn_bias and g2.config.n_kv_heads == 2
    assert all(torch.equal(g2.weights[k], v) for k, v in g.weights.items())


def test_unsupported_architecture_lists_supported():
    with pytest.raises(GraphError, match=r"unsupported architecture 'GPT2LMHeadModel'.*llama, qwen2, qwen3, mistral"):
        config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_bad_inputs(tmp_path):
    with pytest.raises(GraphError, match="unknown model or preset 'nope'"):
        load_model("nope")
    with pytest.raises(GraphError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(GraphError, match="no config.json"):
        from_checkpoint(tmp_path)
    g = small_graph("llama-untied", seed=1)
    g.hf_model().save_pretrained(tmp_path / "ck", max_shard_size="40KB")
    idx = tmp_path / "ck" / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    first = sorted(set(d["weight_map"].values()))[0]
    (tmp_path / "ck" / first).unlink()
    with pytest.raises(GraphError, match=f"shard '{first}' named in the index is missing"):
        from_checkpoint(tmp_path / "ck")
    with pytest.raises(GraphError, match="unsupported dtype 'f8'"):
        load_model("toy", dtype="f8")


def test_wrong_shape_is_named(tmp_path):
    from safetensors.torch import save_file
    g = small_graph("llama-untied", seed=1)
    g.hf_model().save_pretrained(tmp_path)
    w = {k: v.clone() for k, v in g.weights.items()}
    w["model.norm.weight"] = torch.ones(95)
    save_file(w, str(tmp_path / "model.safetensors"))
    with pytest.raises(GraphError, match=r"'model.norm.weight' has shape \(95,\), expected \(96,\)"):
        from_checkpoint(tmp_path)
