"""Decode attention with score tracking over a tiered layer (`storage.tiered`), de-quantizing in registers.

A tiered layer's slots are regions, one per precision tier (`KVRegion`): 16-bit floats, or packed
integer codes with float16 scales and zero points. This kernel walks one region's slots as the
split-K decode kernel of `triton_kernels` walks a dense cache (the G query heads of a KV head as
the rows of one tile, an online softmax, partial (max, sum, acc) per split, the raw logits kept
for the statistics), but loads a block of codes, unpacks them and applies the scales in
registers: the layer is never decoded to full precision in memory. Every region writes its own
splits, and `triton_kernels`' finishing kernel merges all of them into the output and the
column statistics, exactly as for one dense region.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..policies.base import AttentionStats
from . import triton_kernels
from .call import AttentionCall, AttentionResult
from .regions import KVRegion, Scaled
from .select import interpreting
from .triton_kernels import (
    DECODE_MAX_ROWS,
    LOG2E,
    TORCH_ONLY_STATS,
    StatBuffers,
    _as_u8,
    _configs,
    _decode_rows,
    _empty_running,
    _fold_block,
    _num_splits,
    _store_partials,
    finish_decode,
)


@triton.jit
def _load_tile(base, scale_base, zero_base, cols, n_ok, offs_d, d_ok, stride_n, stride_d, stride_sn, stride_sc,
               ROWS, GROUP, BITS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] fp32 tile of slots ``cols`` (its transpose when TRANSPOSED), de-quantized when BITS < 16."""
    if TRANSPOSED:
        n2, d2 = cols[None, :], offs_d[:, None]
        ok = n_ok[None, :] & d_ok[:, None]
    else:
        n2, d2 = cols[:, None], offs_d[None, :]
        ok = n_ok[:, None] & d_ok[None, :]
    if BITS == 16:
        return tl.load(base + n2 * stride_n + d2 * stride_d, mask=ok, other=0.0).to(tl.float32)
    packed = tl.load(base + n2 * stride_n + (d2 // (8 // BITS)) * stride_d, mask=ok, other=0).to(tl.int32)
    codes = (packed >> ((d2 % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)  # the first code of a byte: its lowest bits
    at = (n2 // ROWS) * stride_sn + (d2 // GROUP) * stride_sc
    scale = tl.load(scale_base + at, mask=ok, other=0.0).to(tl.float32)
    zero = tl.load(zero_base + at, mask=ok, other=0.0).to(tl.float32)
    return codes.to(tl.float32) * scale + zero


@triton.jit
def _tiered_partial_kernel(
    Q, K, KS, KZ, V, VS, VZ, KVALID, KPOS, QPOS, S, M_PART, L_PART, C_PART, ACC_PART,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_ksb, stride_ksh, stride_ksn, stride_ksc,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_vsb, stride_vsh, stride_vsn, stride_vsc,
    stride_mb, stride_mh, stride_mn,
    stride_pb, stride_ph, stride_pn,
    stride_qpb, stride_qpm,
    Hkv, G, R, START, COUNT, T_EFF, window, qk_scale, split_len, SPLIT0, NUM_SPLITS,
    KEY_ROWS, KEY_GROUP, VALUE_ROWS, VALUE_GROUP,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, HAS_WINDOW: tl.constexpr, STORE_S: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, kvh, offs_r, offs_d, r_ok, d_ok, q, qpos = _decode_rows(
        Q, QPOS, pid_bh, Hkv, G, R, stride_qb, stride_qh, stride_qm, stride_qd, stride_qpb, stride_qpm,
        HEAD_DIM, BLOCK_D, BLOCK_R,
    )
    q = q.to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    k_base = K + b * stride_kb + kvh * stride_kh
    ks_base = KS + b * stride_ksb + kvh * stride_ksh
    kz_base = KZ + b * stride_ksb + kvh * stride_ksh
    v_base = V + b * stride_vb + kvh * stride_vh
    vs_base = VS + b * stride_vsb + kvh * stride_vsh
    vz_base = VZ + b * stride_vsb + kvh * stride_vsh
    # slot metadata and logits are the layer's (global slot START + local column)
    valid_base = KVALID + b * stride_mb + kvh * stride_mh + START * stride_mn
    pos_base = KPOS + b * stride_pb + kvh * stride_ph + START * stride_pn
    s_base = S + pid_bh.to(tl.int64) * R * T_EFF + START

    m_i, l_i, cnt, acc = _empty_running(BLOCK_R, BLOCK_D)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, COUNT)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < hi
        kt = _load_tile(k_base, ks_base, kz_base, cols, n_ok, offs_d, d_ok, stride_kn, stride_kd, stride_ksn,
                        stride_ksc, KEY_ROWS, KEY_GROUP, BITS, True)
        kval = tl.load(valid_base + cols * stride_mn, mask=n_ok, other=0) != 0
        kpos = tl.load(pos_base + cols * stride_pn, mask=n_ok, other=0)
        vis = kval[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            vis = vis & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(vis, tl.dot(q, kt, input_precision="ieee") * qk_scale, float("-inf"))
        if STORE_S:
            tl.store(s_base + offs_r[:, None] * T_EFF + cols[None, :], s, mask=r_ok[:, None] & n_ok[None, :])
        v = _load_tile(v_base, vs_base, vz_base, cols, n_ok, offs_d, d_ok, stride_vn, stride_vd, stride_vsn,
                       stride_vsc, VALUE_ROWS, VALUE_GROUP, BITS, False)
        m_i, l_i, acc = _fold_block(s, v, m_i, l_i, acc, True)
        cnt += tl.sum(vis.to(tl.float32), 1)

    _store_partials(M_PART, L_PART, C_PART, ACC_PART, pid_bh, SPLIT0 + pid_s, NUM_SPLITS, m_i, l_i, cnt, acc,
                    BLOCK_R, BLOCK_D)


def _operands(part: torch.Tensor | Scaled, dummy: torch.Tensor) -> tuple[list, tuple[int, ...], tuple[int, ...], int, int]:
    """(tensors, their strides, the scales' strides, scale rows, scale group) of one region's keys or values."""
    if isinstance(part, Scaled):
        return [part.codes, part.scale, part.zero], part.codes.stride(), part.scale.stride(), part.rows, part.group
    return [part, dummy, dummy], part.stride(), (0, 0, 0, 0), 1, 1


def attend_tiered_decode(
    query: torch.Tensor,
    regions: list[KVRegion],
    valid: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    needs: frozenset[str],
    query_valid: torch.Tensor | None,
    past_slots: int,
    last_rows: int = 0,
    sliding_window: int | None = None,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """`triton_kernels.attend_tracking_triton`'s decode path over ``regions`` instead of one dense K/V.

    ``query`` [B, Hq, q, D] with G * q <= `DECODE_MAX_ROWS`; ``regions`` tile the layer's slots [0, T) in order;
    ``valid``/``key_positions`` [B, Hkv, T]. Returns the output [B, q, Hq, D] and the statistics in ``needs``.
    """
    batch, q_heads, queries, dim = query.shape
    kv_heads, total = valid.shape[1], valid.shape[2]
    groups = q_heads // kv_heads
    rows = groups * queries
    if rows > DECODE_MAX_ROWS:
        raise ValueError(f"{rows} rows (G={groups} x {queries} queries) exceed the decode tile ({DECODE_MAX_ROWS})")
    if sum(r.count for r in regions) != total or any(r.start != sum(x.count for x in regions[:i])
                                                        for i, r in enumerate(regions)):
        raise ValueError(f"regions {[(r.start, r.count) for r in regions]} must tile the {total} slots in order")
    device = query.device
    interpret = interpreting()
    if device.type != "cuda" and not interpret:
        raise RuntimeError("the Triton backend needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    cfg = {**_configs(dim, interpret), **(config or {})}
    block_d = max(16, triton.next_power_of_2(dim))
    block_r = max(16, triton.next_power_of_2(rows))
    f32 = dict(dtype=torch.float32, device=device)
    dummy = torch.empty(1, **f32)
    t_eff = min(total, past_slots + queries)
    buffers = StatBuffers.allocate(needs, last_rows, queries, (batch, kv_heads, total), t_eff, device)
    any_stats = buffers.any
    out = torch.empty(batch, queries, q_heads, dim, dtype=query.dtype, device=device)
    valid_u8 = _as_u8(valid)
    key_positions = key_positions if key_positions.dtype == torch.long else key_positions.long()
    query_positions = query_positions.to(device=device, dtype=torch.long)

    block_n = cfg["dec_n"]
    plans = []  # (region, slots it walks, split length, splits)
    for region in regions:
        count = max(0, min(region.count, t_eff - region.start))
        if count == 0:
            continue
        splits = _num_splits(batch * kv_heads, count, block_n, interpret, device)
        split_len = triton.cdiv(triton.cdiv(count, splits), block_n) * block_n
        plans.append((region, count, split_len, triton.cdiv(count, split_len)))
    total_splits = max(1, sum(p[3] for p in plans))
    scores = torch.empty(batch * kv_heads, rows, t_eff, **f32) if any_stats else dummy
    m_part = torch.full((batch * kv_heads, total_splits, block_r), float("-inf"), **f32)
    l_part, c_part = torch.zeros_like(m_part), torch.zeros_like(m_part)
    acc_part = torch.zeros(batch * kv_heads, total_splits, block_r, block_d, **f32)
    window = int(sliding_window) if sliding_window is not None else 0
    split0 = 0
    for region, count, split_len, splits in plans:
        keys, key_strides, key_scale_strides, key_rows, key_group = _operands(region.keys, dummy)
        values, value_strides, value_scale_strides, value_rows, value_group = _operands(region.values, dummy)
        _tiered_partial_kernel[(splits, batch * kv_heads)](
            query, *keys, *values, valid_u8, key_positions, query_positions, scores, m_part, l_part, c_part, acc_part,
            *query.stride(), *key_strides, *key_scale_strides, *value_strides, *value_scale_strides,
            *valid_u8.stride(), *key_positions.stride(), *query_positions.stride(),
            kv_heads, groups, rows, region.start, count, t_eff, window, float(scaling) * LOG2E, split_len, split0,
            total_splits, key_rows, key_group, value_rows, value_group,
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_N=block_n, BITS=region.bits,
            HAS_WINDOW=sliding_window is not None, STORE_S=any_stats,
            num_warps=cfg["dec_warps"], num_stages=cfg["dec_stages"],
        )
        split0 += splits

    qvalid_u8 = _as_u8(query_valid.to(device)) if query_valid is not None else None
    finish_decode((m_part, l_part, c_part, acc_part), scores, qvalid_u8, out, buffers, groups, total, t_eff,
                  total_splits, block_r, cfg["finish_n"], dummy)
    return out, buffers.stats(query_valid, batch, queries, device)


def attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    """A tiered layer's call on the Triton backend: decode steps with statistics read the codes in place; any other
    call (a prompt, plain attention, the torch-only statistics) decodes the layer and runs as a dense one."""
    groups = query.shape[1] // call.valid.shape[1]
    if call.needs and not call.needs & TORCH_ONLY_STATS and groups * query.shape[2] <= DECODE_MAX_ROWS:
        out, stats = attend_tiered_decode(
            query, call.regions, call.valid, call.key_positions, call.query_positions, call.scaling, call.needs,
            call.query_valid, call.past_slots, call.last_rows_window, call.sliding_window,
        )
        return AttentionResult(out, stats)
    return triton_kernels.attend(query, call.decoded())
