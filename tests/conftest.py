"""Test-wide setup."""

import os

# Triton runs on CPU only through its interpreter, and it reads this when first imported
# (transformers imports it early through torch._dynamo), so it must be set before torch.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import random  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, text file) of a tiny random Llama and a char tokenizer, for `--model` and `--text-file`."""
    from tiny_models import char_tokenizer, tiny_model

    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    words = "the cache keeps a few tokens and drops the rest while the model reads on".split()
    rng = random.Random(0)
    text = tmp_path_factory.mktemp("text") / "text.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(400)) + "\n")
    return str(folder), str(text)
