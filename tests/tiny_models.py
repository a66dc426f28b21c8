"""Tiny random-weight models built from transformers configs (no download)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3, max_position_embeddings=512)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":  # GQA, 3 query heads per KV head
        config = LlamaConfig(**COMMON, num_attention_heads=6, num_key_value_heads=2)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":  # GQA with q/k/v biases
        config = Qwen2Config(**COMMON, num_attention_heads=6, num_key_value_heads=3)
        model = Qwen2ForCausalLM(config)
    elif arch == "mistral":  # GQA, 4 query heads per KV head
        config = MistralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, sliding_window=None)
        model = MistralForCausalLM(config)
    elif arch == "opt":  # MHA, learned positions (the H2O paper's model family)
        config = OPTConfig(
            vocab_size=VOCAB, hidden_size=96, ffn_dim=160, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=512, word_embed_proj_dim=96, pad_token_id=0,
        )
        model = OPTForCausalLM(config)
    else:
        raise ValueError(arch)
    # random init gives near-uniform attention; sharper weights make eviction choices matter
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model.eval()


ARCHS = ["llama", "qwen2", "mistral", "opt"]


def padded_batch(seed: int = 1, lengths: tuple[int, ...] = (17, 11, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch of prompts of different lengths (pad id 0, never a real token)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (ids 3..98), within the tiny models' 128-token vocabulary."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
