"""Shared fixtures: small odd-sized model configs of every family, and GPU skipping for @pytest.mark.cuda."""
from __future__ import annotations

import pytest
import torch

from schedule.graph import ModelConfig, ModelGraph, random_weights


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}

# Odd sizes on purpose: hidden 96, 6 heads / 2 KV heads (GQA 3), head_dim 16, vocab 313, intermediate 176.
SMALL_CONFIGS = {
    "llama-untied": ModelConfig("llama", 313, 96, 176, 2, 6, 2, 16, 1e-5, 10000.0, None, False, max_position=256),
    "llama-tied-rope3": ModelConfig("llama", 313, 96, 176, 2, 6, 2, 16, 1e-5, 500000.0, _LLAMA3, True,
                                    max_position=256),
    "qwen3": ModelConfig("qwen3", 313, 96, 176, 2, 6, 2, 16, 1e-6, 1000000.0, None, True, qk_norm=True,
                         max_position=256),
    "qwen2": ModelConfig("qwen2", 313, 96, 176, 2, 6, 2, 16, 1e-6, 10000.0, None, False, attn_bias=True,
                         max_position=256),
    "mistral-window": ModelConfig("mistral", 313, 96, 176, 2, 6, 2, 16, 1e-5, 10000.0, None, False,
                                  sliding_window=7, max_position=256),
}


def small_graph(name: str, seed: int = 0, dtype: str = "f32") -> ModelGraph:
    c = SMALL_CONFIGS[name]
    return ModelGraph(name, c, random_weights(c, dtype, seed), dtype)


@pytest.fixture(params=sorted(SMALL_CONFIGS))
def family_graph(request):
    return small_graph(request.param, seed=7)
