"""Test-wide setup."""

import os

# Triton runs on CPU only through its interpreter, and it reads this when first imported
# (transformers imports it early through torch._dynamo), so it must be set before torch.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
