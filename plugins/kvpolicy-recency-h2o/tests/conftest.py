"""Shared fixtures: a tiny random Llama built from a transformers config (no download)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kvpolicy's Triton backend runs on CPU only interpreted
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random init attends almost uniformly; sharper q/k make eviction choices matter
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model
