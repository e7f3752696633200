"""Shared fixtures: a tiny random model and the embedded SmolLM2 (loaded once per session)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from models.config import ModelConfig  # noqa: E402
from models.llama import init_params  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests are skipped, visibly, when no GPU backend is present."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = ModelConfig(name="tiny", vocab_size=97, hidden_size=64, intermediate_size=128,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                   rope_theta=10000.0, max_position_embeddings=512,
                   tie_word_embeddings=False, qkv_bias=True)


@pytest.fixture(scope="session")
def tiny_model():
    """(cfg, params) of a 3-layer random model with GQA, biases and an untied head."""
    return TINY, init_params(TINY, jax.random.PRNGKey(0), jnp.float32)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct at float32 (cfg, params, tokenizer)."""
    from models.loading import load_model
    return load_model("smollm2-135m", dtype=jnp.float32, use_cache=False)
