"""The Hugging Face transformers integration: the attention function, the cache, the session, model loading.

Needs the ``transformers`` extra (``pip install "kvpolicy[transformers]"``).
"""
