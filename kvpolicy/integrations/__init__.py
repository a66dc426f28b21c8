"""Engines other than transformers that run kvpolicy recipes (each in its own subpackage, with its own extra)."""
