"""`amk generate` end to end on CPU (issue 6): tiny Llama and Qwen3 checkpoints written with save_pretrained
(random weights, odd sizes) decode 32 tokens identical to transformers greedy; bad inputs are one clear line."""
from __future__ import annotations

import json

import pytest
import torch

from eval.equivalence import hf_greedy
from tests.conftest import small_graph
from tests.test_cli import amk


@pytest.mark.parametrize("family", ["llama-untied", "qwen3"])
def test_checkpoint_generate_32_tokens_identical(tmp_path, family):
    g = small_graph(family, seed=31)
    model = g.hf_model()
    model.save_pretrained(tmp_path / "ck", max_shard_size="60KB")           # sharded on purpose
    prompt = [11, 250, 3, 77, 190]
    r = amk("generate", tmp_path / "ck", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "32",
            "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == hf_greedy(model, prompt, 32)


def _ck(tmp_path, family="llama-untied"):
    g = small_graph(family, seed=2)
    g.hf_model().save_pretrained(tmp_path / "ck", max_shard_size="60KB")
    return tmp_path / "ck"


def _bad(r, msg):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert msg in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_generate_bad_inputs(tmp_path):
    ck = _ck(tmp_path)
    gen = ("generate", ck, "--prompt-ids", "1,2", "--max-tokens", "4", "--device", "cpu")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[-1]
    (ck / shard).rename(ck / "moved.bin")
    _bad(amk(*gen), f"shard '{shard}' named in the index is missing")
    (ck / "moved.bin").rename(ck / shard)
    (ck / "config.json").rename(ck / "c.json")
    _bad(amk(*gen), "no config.json")
    (ck / "c.json").rename(ck / "config.json")
    _bad(amk("generate", ck, "--prompt-ids", ",".join(["1"] * 300), "--max-tokens", "4", "--device", "cpu"),
         "exceeds the model's context 256")
    _bad(amk("generate", ck, "--prompt", "hello", "--device", "cpu"), "has no tokenizer.json")
    _bad(amk("generate", ck, "--prompt-ids", "1", "--dtype", "f8"), "invalid choice: 'f8'")


def test_wrong_shape_and_dtype_in_checkpoint(tmp_path):
    from safetensors.torch import save_file
    g = small_graph("llama-untied", seed=2)
    g.hf_model().save_pretrained(tmp_path / "ck")
    w = {k: v.clone() for k, v in g.weights.items()}
    w["model.layers.1.mlp.up_proj.weight"] = torch.zeros(175, 96)
    save_file(w, str(tmp_path / "ck" / "model.safetensors"))
    _bad(amk("generate", tmp_path / "ck", "--prompt-ids", "1", "--device", "cpu"),
         "'model.layers.1.mlp.up_proj.weight' has shape (175, 96), expected (176, 96)")
    w = {k: v.to(torch.float64) for k, v in g.weights.items()}
    save_file(w, str(tmp_path / "ck" / "model.safetensors"))
    _bad(amk("generate", tmp_path / "ck", "--prompt-ids", "1", "--device", "cpu"), "unsupported weight dtype")


def test_prompt_text_with_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    ck = _ck(tmp_path)
    vocab = {f"w{i}": i for i in range(313)}
    vocab["[UNK]"] = 0
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ck / "tokenizer.json"))
    r = amk("generate", ck, "--prompt", "w5 w17 w200", "--max-tokens", "6", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref = hf_greedy(small_graph("llama-untied", seed=2).hf_model(), [5, 17, 200], 6)
    assert out["tokens"] == ref and out["text"].split() == [f"w{t}" for t in ref]


def test_generate_with_several_steps_per_launch(tmp_path):
    """A config of 3 greedy steps per launch decodes the same tokens as transformers (CPU reference VM); the KV
    cache then holds the last launch's 2 extra positions, and a request whose launches pass the model's context
    is one clear line."""
    g = small_graph("llama-untied", seed=5)
    model = g.hf_model()
    model.save_pretrained(tmp_path / "ck")
    (tmp_path / "s3.json").write_text(json.dumps({"steps_per_launch": 3}))
    prompt = [9, 40, 3]
    r = amk("generate", tmp_path / "ck", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "7",
            "--device", "cpu", "--config", tmp_path / "s3.json", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == hf_greedy(model, prompt, 7)
    n = g.config.max_position - len(prompt)   # fits one step per launch, not the last launch's 2 extra positions
    _bad(amk("generate", tmp_path / "ck", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n),
             "--device", "cpu", "--config", tmp_path / "s3.json"), "for launches of steps_per_launch 3")
