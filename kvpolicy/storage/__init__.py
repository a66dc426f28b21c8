"""Storage formats of a cache layer: the K/V tensors and the per-slot metadata that moves with them.

`base.KVStore` is the interface the cache layer uses (append, the K/V attention reads, evict to a
keep-set, drop one, bytes), over a `slots.SlotTable`. Three formats implement it: `dense.DenseStore`
(every cell the room of the largest), `ragged.RaggedStore` (a segment per cell, sized to its own
budget) and `tiered.TieredStore` (precision tiers: each tier a region of the slots). A tier stores its
tokens through a `tier_formats.TierFormat` (16-bit floats, or `quant_tier.QuantTier`'s integer codes,
whose keys scale as `key_codecs` says, on `quant`'s primitives); `tier_sizing` splits a cell's budget
among the tiers at the bytes they cost.
"""
