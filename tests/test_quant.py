"""kvpolicy.storage.quant: packing, the error bounds of per-token values and per-channel keys, range widening
with re-encoding, tokens moved by compaction, degenerate ranges, bytes, and 4-bit K/V of the real model."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.storage.quant import (
    BITS,
    ChannelRange,
    QuantizedRows,
    bytes_per_token,
    dequantize_per_token,
    key_range_bytes,
    pack,
    quantize_per_token,
    unpack,
)

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_error.py"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _keys_like(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Offset data with channels of very different sizes and a few outliers, like real keys."""
    gen = _gen(seed)
    channel_size = 10 ** (torch.rand(shape[-1], generator=gen) * 3 - 2)  # 0.01 .. 10
    x = 20 + torch.randn(shape, generator=gen) * channel_size
    x.view(-1)[:: 97] *= 40  # outliers
    return x


def _slack(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """float32 arithmetic's share of an error: far below any float16 rounding of the scale (2**-11)."""
    return step * 1e-4 + x.abs() * 1e-6


# --- packing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(64,), (3, 40), (2, 3, 5, 16)])
def test_pack_unpack_round_trip(bits, shape):
    codes = torch.randint(0, 2**bits, shape, dtype=torch.uint8, generator=_gen(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] * bits // 8)
    assert torch.equal(unpack(packed, bits, shape[-1]), codes)


def test_pack_puts_the_first_code_in_the_lowest_bits():
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack(torch.tensor([5, 12], dtype=torch.uint8), 4).tolist() == [5 | 12 << 4]


@pytest.mark.parametrize("bits, n", [(2, 6), (2, 3), (4, 5)])
def test_sizes_that_do_not_fill_whole_bytes_are_refused(bits, n):
    with pytest.raises(KVPolicyError, match=f"{n} does not fill whole bytes at {bits} bits.*multiple of {8 // bits}"):
        pack(torch.zeros(n, dtype=torch.uint8), bits)
    with pytest.raises(KVPolicyError, match="multiple of"):
        unpack(torch.zeros(1, dtype=torch.uint8), bits, n)


def test_bad_arguments_name_themselves_and_the_fix():
    with pytest.raises(KVPolicyError, match="bits=3 .* use 2, 4 or 8"):
        pack(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(KVPolicyError, match="codes must be uint8"):
        pack(torch.zeros(8, dtype=torch.int64), 4)
    with pytest.raises(KVPolicyError, match=r"packed must be uint8 \[\.\.\., 4\] for n=8"):
        unpack(torch.zeros(3, dtype=torch.uint8), 4, 8)
    with pytest.raises(KVPolicyError, match="group=48 does not divide head_dim=64"):
        quantize_per_token(torch.zeros(2, 64), 4, 48)
    with pytest.raises(KVPolicyError, match="margin=0.9 must be at least 1"):
        ChannelRange.empty((2,), 64, 4, margin=0.9)
    keys_range = ChannelRange.fit(torch.zeros(2, 3, 5, 64), 4)
    with pytest.raises(KVPolicyError, match=r"keys \[2, 5, 64\] do not match the range's cells \[2, 3\]"):
        keys_range.encode(torch.zeros(2, 5, 64))
    with pytest.raises(KVPolicyError, match=r"codes must be uint8 \[2, 3, S, 32\]"):
        keys_range.decode(torch.zeros(2, 3, 5, 64, dtype=torch.uint8))


# --- error bounds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_values_per_token_decode_within_half_a_stored_step(bits):
    x = _keys_like((2, 3, 50, 64)).transpose(-1, -2).contiguous().view(2, 3, 50, 64)  # outliers per token too
    rows = quantize_per_token(x, bits, 32)
    assert rows.scale.dtype == rows.zero.dtype == torch.float16
    assert rows.packed.shape == (2, 3, 50, 64 * bits // 8) and rows.scale.shape == (2, 3, 50, 2)
    step = rows.scale.float().repeat_interleave(32, dim=-1)
    error = (dequantize_per_token(rows) - x).abs()
    assert (error <= step / 2 + _slack(x, step)).all(), float((error / step).max())


@pytest.mark.parametrize("bits", BITS)
def test_keys_per_channel_decode_within_half_a_stored_step(bits):
    x = _keys_like((2, 3, 50, 64))
    keys_range = ChannelRange.fit(x, bits)
    assert keys_range.scale.shape == (2, 3, 1, 64) and keys_range.scale.dtype == torch.float16
    codes = keys_range.encode(x)
    assert codes.shape == (2, 3, 50, 64 * bits // 8)
    step = keys_range.scale.float()
    error = (keys_range.decode(codes) - x).abs()
    assert (error <= step / 2 + _slack(x, step)).all(), float((error / step).max())


@pytest.mark.parametrize("scheme", ["values per token", "keys per channel"])
def test_mean_squared_error_is_a_twelfth_of_the_stored_step_squared(scheme):
    """The Δ²/12 law on Gaussian data far from zero (50 + N(0, 1)): the error is Δ²/12 with Δ the float16 step
    actually stored, so rounding by truncation (Δ²/3) fails, and so does rounding with float32 scale and zero
    and decoding with their float16 copies (at 50 a float16 zero is off by up to 2**-6, a step at 8 bits).
    The error then drops by about 4x per extra bit: ((2**b' - 1) / (2**b - 1))**2 from b to b' bits."""
    x = 50 + torch.randn(4, 4, 256, 64, generator=_gen(1))
    relative_mse = {}
    for bits in BITS:
        if scheme == "values per token":
            rows = quantize_per_token(x, bits, 32)
            decoded, step = dequantize_per_token(rows), rows.scale.float()
        else:
            keys_range = ChannelRange.fit(x, bits)
            decoded, step = keys_range.decode(keys_range.encode(x)), keys_range.scale.float()
        mse = float((decoded - x).square().mean())
        law = float(step.square().mean()) / 12
        # measured 0.944-0.975 (values: the group's min and max sit on the grid) and 0.995-1.000 (keys)
        assert 0.9 < mse / law < 1.05, (bits, mse / law)
        relative_mse[bits] = mse / float(x.var())
    for low, high in [(2, 4), (4, 8)]:
        drop = relative_mse[low] / relative_mse[high]
        expected = ((2**high - 1) / (2**low - 1)) ** 2  # 25 and 289: 5x and 4.1x per bit
        assert 0.85 < drop / expected < 1.15, (low, high, drop)
        assert 3.5 < drop ** (1 / (high - low)) < 5.5


# --- keys: widening and re-encoding ----------------------------------------------------------------------


def test_widening_reencodes_only_the_channels_that_widened():
    bits = 4
    old = _keys_like((2, 3, 40, 64), seed=2)
    keys_range = ChannelRange.fit(old, bits)
    codes = keys_range.encode(old)
    before_codes, before = codes.clone(), keys_range
    new = old[:, :, :6].clone()  # inside the range...
    new[0, 1, 2, 5] = 1000.0  # ...except channel 5 of cell (0, 1), above
    new[1, 2, 0, :4] = -500.0  # and channels 0-3 of cell (1, 2), below
    widened = torch.zeros(2, 3, 1, 64, dtype=torch.bool)
    widened[0, 1, 0, 5] = widened[1, 2, 0, :4] = True

    keys_range, codes = keys_range.widen(new, codes)
    assert torch.equal(keys_range.scale[~widened], before.scale[~widened])  # bit for bit
    assert torch.equal(keys_range.zero[~widened], before.zero[~widened])
    assert (keys_range.scale[widened] > before.scale[widened]).all()
    untouched = ~widened.any(dim=-1).squeeze(-1)  # [2, 3] cells
    assert torch.equal(codes[untouched], before_codes[untouched])
    assert torch.equal(unpack(codes, bits, 64)[0, 1][:, [c for c in range(64) if c != 5]],
                       unpack(before_codes, bits, 64)[0, 1][:, [c for c in range(64) if c != 5]])
    # the margin: the widened span is 1.25x the span needed, on the side that overflowed
    top = keys_range.zero.float() + 15 * keys_range.scale.float()
    low = before.zero[0, 1, 0, 5].float()
    assert float(top[0, 1, 0, 5] - low) >= 1.25 * float(1000.0 - low) * 0.999
    assert keys_range.zero[0, 1, 0, 5] == before.zero[0, 1, 0, 5]

    # tokens encoded before: within half the old step plus half the new (the re-encoding); new ones: half a step
    old_step, new_step = before.scale.float(), keys_range.scale.float()
    error = (keys_range.decode(codes) - old).abs()
    assert (error <= (old_step + new_step) / 2 + _slack(old, new_step)).all()
    assert ((old_step + new_step)[widened] / 2 <= new_step[widened] * (1 + 1 / 1.25) / 2 * 1.001).all()
    fresh = (keys_range.decode(keys_range.encode(new)) - new).abs()
    assert (fresh <= new_step / 2 + _slack(new, new_step)).all()


def test_repeated_widening_stays_within_the_accumulated_bound():
    """Keys that drift upward token by token: many widenings; every key within the range's accumulated bound."""
    gen = _gen(3)
    keys = torch.randn(2, 3, 200, 64, generator=gen) + torch.linspace(0, 30, 200)[:, None]
    keys_range = ChannelRange.fit(keys[:, :, :8], 4)
    codes = keys_range.encode(keys[:, :, :8])
    steps = 0
    for start in range(8, 200, 4):
        chunk = keys[:, :, start : start + 4]
        grown, codes = keys_range.widen(chunk, codes)
        steps += int((grown.scale != keys_range.scale).any())
        keys_range = grown
        codes = torch.cat([codes, keys_range.encode(chunk)], dim=2)
    assert steps >= 5
    error = (keys_range.decode(codes) - keys).abs()
    assert (error <= keys_range.accumulated_bound() + _slack(keys, keys_range.scale.float())).all()


def test_pads_do_not_widen_and_empty_cells_fit_their_first_keys():
    keys = _keys_like((2, 3, 10, 64), seed=4)
    valid = torch.ones(2, 3, 10, dtype=torch.bool)
    valid[0, :, :4] = False  # left pads of row 0
    valid[1, 2] = False  # a cell with no token yet
    keys[0, :, :4] = 1e4  # pads' keys, far outside
    keys_range = ChannelRange.fit(keys, 8, valid=valid)
    assert keys_range.fitted.squeeze().tolist() == [[True] * 3, [True, True, False]]
    real = ChannelRange.fit(keys[0, :, 4:], 8)  # the pads did not widen row 0's ranges
    assert torch.equal(keys_range.scale[0], real.scale) and torch.equal(keys_range.zero[0], real.zero)
    codes = keys_range.encode(keys)
    assert torch.equal(keys_range.decode(codes)[1, 2], torch.zeros(10, 64))  # an empty cell decodes to 0
    later = _keys_like((2, 3, 3, 64), seed=5)
    grown, codes = keys_range.widen(later, codes)
    assert grown.fitted.all()
    exact = ChannelRange.fit(later[1, 2], 8)
    assert torch.equal(grown.scale[1, 2], exact.scale) and torch.equal(grown.zero[1, 2], exact.zero)


# --- compaction ------------------------------------------------------------------------------------------


def test_moved_and_dropped_tokens_decode_as_before():
    """Compaction gathers tokens along T (each cell its own order, some dropped): keys keep their cell's range
    and values carry their own scales, so every survivor decodes bit for bit as before."""
    keys, values = _keys_like((2, 3, 30, 64), seed=6), _keys_like((2, 3, 30, 64), seed=7)
    keys_range = ChannelRange.fit(keys, 4)
    key_codes, rows = keys_range.encode(keys), quantize_per_token(values, 2, 32)
    order = torch.rand(2, 3, 30, generator=_gen(8)).argsort(dim=-1)[..., :17]  # a new order, 13 dropped

    def take(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.gather(2, order[..., None].expand(*order.shape, tensor.shape[-1]))

    moved_rows = QuantizedRows(take(rows.packed), take(rows.scale), take(rows.zero), rows.bits)
    assert torch.equal(keys_range.decode(take(key_codes)), take(keys_range.decode(key_codes)))
    assert torch.equal(dequantize_per_token(moved_rows), take(dequantize_per_token(rows)))


# --- degenerate ranges -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_constant_channels_and_single_tokens_stay_finite_and_exact(bits):
    x = torch.randn(2, 3, 8, 64, generator=_gen(9))
    x[..., :32] = 0.0  # a whole per-token group of zeros, and constant key channels
    x[..., 32:40] = 3.0
    x[1] = -7.25  # whole cells constant
    rows = quantize_per_token(x, bits, 32)
    keys_range = ChannelRange.fit(x, bits)
    # exact: the zero group of the values, the constant channels of the keys, the constant cells of both
    for decoded, exact in ((dequantize_per_token(rows), 32), (keys_range.decode(keys_range.encode(x)), 40)):
        assert torch.isfinite(decoded).all()
        assert torch.equal(decoded[..., :exact], x[..., :exact]) and torch.equal(decoded[1], x[1])
    single = ChannelRange.fit(x[:, :, :1], bits)  # one token: zero span
    assert torch.isfinite(single.scale.float()).all() and (single.scale > 0).all()
    grown, codes = single.widen(x, single.encode(x[:, :, :1]))
    assert torch.isfinite(grown.decode(codes)).all()


# --- bytes -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [32, 64])
def test_bytes_per_token_is_what_the_tensors_hold(bits, group):
    tokens = 10
    x = torch.randn(1, 1, tokens, 64, generator=_gen(10))
    rows = quantize_per_token(x, bits, group)
    keys_range = ChannelRange.fit(x, bits)
    size = bytes_per_token(64, bits, group)
    assert size.values * tokens == sum(t.numel() * t.element_size() for t in (rows.packed, rows.scale, rows.zero))
    assert size.keys * tokens == keys_range.encode(x).numel()
    assert key_range_bytes(64) == sum(t.numel() * t.element_size() for t in (keys_range.scale, keys_range.zero))
    assert size.total == size.keys + size.values
    assert bytes_per_token(64, 4, 32) == (32, 40)


# --- the real model --------------------------------------------------------------------------------------


def _benchmark():
    spec = importlib.util.spec_from_file_location("quant_error", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smollm2():
    return kvpolicy.load_model("smollm2")


@pytest.mark.slow
def test_real_keys_and_values_at_4_bits_keep_attention_close(smollm2):
    """SmolLM2's K (after RoPE) and V of layers 0, 15 and 29 over 512 tokens of pydoc text: 4-bit keys per
    channel over 32-slot blocks written 8 at a time (kvpolicy's default, as a tier meets them) and 4-bit values
    per token (group 32). Measured (pooled over the layers): keys 4.6%, values 8.0%, the attention output with
    the real queries 7.8% with both (2 bits: 41%), against 13.4% with one range per cell widened as tokens
    arrive (`keys: cell`); the bounds leave ~1.4x margin."""
    bench = _benchmark()
    layers = bench.capture(*smollm2, tokens=512, layers=(0, 15, 29))
    assert layers[0].keys.shape == (1, 3, 512, 64) and layers[0].query.shape == (1, 9, 512, 64)
    key_error, _ = bench.errors(layers, 4, key_scheme=bench.keys_in_blocks_streamed)
    value_error, _ = bench.errors(layers, 4, value_scheme=bench.per_token(32))
    _, output_error = bench.errors(layers, 4, bench.keys_in_blocks_streamed, bench.per_token(32))
    _, cell_output_error = bench.errors(layers, 4, bench.keys_per_channel_streamed, bench.per_token(32))
    assert key_error < 0.065, key_error
    assert value_error < 0.11, value_error
    assert output_error < 0.11, output_error
    assert output_error < 0.7 * cell_output_error, (output_error, cell_output_error)
