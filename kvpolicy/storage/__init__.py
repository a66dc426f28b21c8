"""Storage formats of a cache layer: the K/V tensors and the per-slot metadata that moves with them.

`base.KVStore` is the interface the layer uses (append, the K/V attention reads, evict to a
keep-set, bytes); `dense.DenseStore` and `ragged.RaggedStore` implement it. A new format
(e.g. tokens kept at lower precision) is a new module implementing `KVStore`; `quant` holds the
quantization primitives such a format builds on.
"""
