"""Key codecs of a quantized tier (`kvpolicy.storage.key_codecs`): blocks of slots (KIVI), one range per cell, per token."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.storage.key_codecs import KEY_BLOCK, KEY_CODECS, BlockKeys, read_all
from kvpolicy.storage.quant import ChannelRange, key_range_bytes

B, H, D = 2, 3, 64


def outlier_keys(tokens: int, seed: int = 0) -> torch.Tensor:
    """Keys like real ones: most channels small, a few with a large offset and spread (the reason for per-channel scales)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, tokens, D, generator=g)
    keys[..., :4] = keys[..., :4] * 8 + 20
    return keys


def write_all(codec, keys: torch.Tensor, step: int) -> None:
    """Write ``keys`` into slots 0.. of an empty codec, ``step`` tokens per write, nothing ever leaving."""
    tokens = keys.shape[2]
    codec.resize(tokens, 0)
    for start in range(0, tokens, step):
        count = min(step, tokens - start)
        slots = torch.arange(start, start + count).expand(B, H, count)
        kept = (torch.arange(tokens) < start).expand(B, H, tokens)
        codec.write(slots, keys[:, :, start : start + count], torch.ones(B, H, count, dtype=torch.bool), kept)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_blocks_written_at_once_are_kivi_groups_exactly(bits):
    """Slots written whole blocks at a time hold what a per-channel range over each group of 32 tokens gives."""
    keys = outlier_keys(3 * KEY_BLOCK)
    codec = BlockKeys(bits, 32, B, H, D, torch.device("cpu"))
    write_all(codec, keys, KEY_BLOCK)
    groups = keys.view(B, H, 3, KEY_BLOCK, D)
    expected_range = ChannelRange.fit(groups, bits)
    expected = expected_range.decode(expected_range.encode(groups)).flatten(2, 3)
    assert torch.equal(read_all(codec, 3 * KEY_BLOCK, torch.float32), expected)
    assert (expected - keys).abs().max() <= expected_range.bound().max()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_blocks_filled_a_few_at_a_time_stay_within_the_accumulated_bound(bits):
    keys = outlier_keys(100, seed=1)
    codec = BlockKeys(bits, 32, B, H, D, torch.device("cpu"))
    write_all(codec, keys, 5)  # blocks fill over several writes: their ranges widen and re-encode
    decoded = read_all(codec, 100, torch.float32)
    bound = codec.accumulated_bound().repeat_interleave(KEY_BLOCK, dim=2).flatten(2, 3)[:, :, :100]
    assert bool(((decoded - keys).abs() <= bound * (1 + 1e-3) + 1e-6).all())


def test_blocks_beat_one_range_per_cell_on_keys_with_drifting_channels():
    """The point of blocks: a channel whose level drifts over time gets a narrow range per block, not one wide range."""
    keys = outlier_keys(256, seed=2)
    keys += torch.linspace(0, 30, 256)[:, None]  # every channel drifts by 30 over the stream
    errors = {}
    for name in ("channel", "cell"):
        codec = KEY_CODECS[name](4, 32, B, H, D, torch.device("cpu"))
        write_all(codec, keys, 8)
        errors[name] = float((read_all(codec, 256, torch.float32) - keys).norm() / keys.norm())
    assert errors["channel"] < errors["cell"] / 3, errors


@pytest.mark.parametrize("name", sorted(KEY_CODECS))
def test_reading_slots_equals_reading_all_then_gathering(name):
    keys = outlier_keys(70, seed=3)
    codec = KEY_CODECS[name](4, 32, B, H, D, torch.device("cpu"))
    write_all(codec, keys, 7)
    slots = torch.randint(0, 70, (B, H, 20), generator=torch.Generator().manual_seed(0))
    every = read_all(codec, 70, torch.float32)
    assert torch.equal(codec.read(slots, torch.float32), every.gather(2, slots[..., None].expand(-1, -1, -1, D)))


@pytest.mark.parametrize("name", sorted(KEY_CODECS))
def test_an_emptied_block_or_cell_fits_its_next_keys_afresh(name):
    """Huge keys that all left must not leave a wide range behind: the next, small keys decode as if alone."""
    codec = KEY_CODECS[name](4, 32, B, H, D, torch.device("cpu"))
    codec.resize(KEY_BLOCK, 0)
    slots = torch.arange(KEY_BLOCK).expand(B, H, KEY_BLOCK)
    present = torch.ones(B, H, KEY_BLOCK, dtype=torch.bool)
    nothing = torch.zeros(B, H, KEY_BLOCK, dtype=torch.bool)
    codec.write(slots, 1000 * outlier_keys(KEY_BLOCK, seed=4), present, nothing)
    small = outlier_keys(KEY_BLOCK, seed=5)
    codec.write(slots, small, present, nothing)  # every earlier token left: nothing is kept
    alone = KEY_CODECS[name](4, 32, B, H, D, torch.device("cpu"))
    alone.resize(KEY_BLOCK, 0)
    alone.write(slots, small, present, nothing)
    assert torch.equal(read_all(codec, KEY_BLOCK, torch.float32), read_all(alone, KEY_BLOCK, torch.float32))


@pytest.mark.parametrize("name", sorted(KEY_CODECS))
@pytest.mark.parametrize("capacity", [1, 31, 32, 33, 100])
def test_bytes_held_are_within_the_cost_charged(name, capacity):
    """What the budget solver charges (token_bytes per slot + cell_bytes) covers what the tensors hold."""
    codec = KEY_CODECS[name](4, 32, B, H, D, torch.device("cpu"))
    codec.resize(capacity, 0)
    charged = B * H * (capacity * codec.token_bytes() + codec.cell_bytes())
    assert codec.nbytes() <= charged
    if name == "channel":  # a block's range is 8 bytes a slot at head size 64, and the last block is covered
        assert codec.token_bytes() == D * 4 // 8 + key_range_bytes(D) // KEY_BLOCK
