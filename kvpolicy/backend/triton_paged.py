"""Decode attention over a paged KV cache in Triton, reading the blocks in place: the GPU path of the vLLM
integration's `PagedPolicies` (`kvpolicy/integrations/vllm/paged.py`), same contract as its torch path.

A request's logical blocks are listed in a block table; slot ``j * block_size + t`` of a request is slot ``t`` of
its ``j``-th block, and ``valid`` says which slots hold a token for each KV head (an arena's free slots and the
evicted head of a block do not). Two kernels, one query per request (a decode step):

* `_paged_decode_kernel`, one program per (request, KV head): the G query heads of the KV head as the rows of one
  tile, an online softmax over the request's blocks (no copy of K/V, no ``repeat_kv``); writes the output and each
  row's base-2 log-sum-exp.
* `_paged_scores_kernel`, one program per (request, KV head, block): the *score pass*. From any kernel's
  log-sum-exp (this one's, or FlashAttention's on a layout without holes) it recomputes ``exp2(q.k * scale -
  lse)`` for one block and writes its column sums, averaged over the G query heads: the statistic H2O reads
  (and TOVA's last row, the same thing for one query).
* `_move_slots_kernel`, one program per moved (token, KV head): an eviction's compaction, each kept token that
  lies past a request's first ``budget`` slots copied into the slot of a dropped one, in the cache as it lies.

Probabilities are fp32 whatever the cache's dtype. Under ``TRITON_INTERPRET=1`` these run on CPU (slowly): that is
how the tests check them against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _block_scores(Q_TILE, K, TABLE, VALID, r, kvh, j, stride_kb, stride_kh, stride_kn, stride_kd, stride_tr,
                  stride_vr, stride_vh, qk_scale, offs_n, offs_d, d_ok, BLOCK_SIZE: tl.constexpr):
    """Scaled base-2 logits [G, block_size] of block ``j`` of request ``r`` for KV head ``kvh`` (-inf where no
    token), the slots' validity, and the block's id in the cache."""
    block = tl.load(TABLE + r * stride_tr + j).to(tl.int64)
    keys = tl.load(K + block * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   mask=d_ok[None, :], other=0.0).to(tl.float32)
    valid = tl.load(VALID + r * stride_vr + kvh * stride_vh + j * BLOCK_SIZE + offs_n) != 0
    logits = tl.sum(Q_TILE[:, None, :] * keys[None, :, :], axis=2) * qk_scale
    return tl.where(valid[None, :], logits, float("-inf")), valid, block


@triton.jit
def _program_rows(Q, Hkv, G, stride_qr, stride_qh, stride_qd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A program's request and KV head (from its first grid axis), its offsets, and the G query heads of that KV
    head as the rows of one fp32 tile."""
    pid = tl.program_id(0)
    r = (pid // Hkv).to(tl.int64)
    kvh = pid % Hkv
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    heads = kvh * G + offs_g
    q = tl.load(Q + r * stride_qr + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=(offs_g < G)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return r, kvh, offs_g, offs_n, offs_d, d_ok, q


@triton.jit
def _paged_decode_kernel(
    Q, K, V, TABLE, VALID, OUT, LSE,
    stride_qr, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_tr, stride_mr, stride_mh,
    stride_or, stride_oh, stride_od,
    Hkv, G, NUM_BLOCKS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    r, kvh, offs_g, offs_n, offs_d, d_ok, q = _program_rows(Q, Hkv, G, stride_qr, stride_qh, stride_qd, HEAD_DIM,
                                                          BLOCK_D, BLOCK_G, BLOCK_SIZE)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j in range(NUM_BLOCKS):
        s, valid, block = _block_scores(q, K, TABLE, VALID, r, kvh, j, stride_kb, stride_kh, stride_kn, stride_kd,
                                        stride_tr, stride_mr, stride_mh, qk_scale, offs_n, offs_d, d_ok, BLOCK_SIZE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no token yet keeps -inf: shift by 0 there (exp2(-inf - 0) = 0, no NaN)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        values = tl.load(V + block * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn
                         + offs_d[None, :] * stride_vd, mask=d_ok[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    heads = kvh * G + offs_g
    g_ok = offs_g < G
    tl.store(OUT + r * stride_or + heads[:, None] * stride_oh + offs_d[None, :] * stride_od, out,
             mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE + r * (Hkv * G) + heads, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit
def _paged_scores_kernel(
    Q, K, TABLE, VALID, LSE, COLSUM,
    stride_qr, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_tr, stride_mr, stride_mh,
    Hkv, G, NUM_BLOCKS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    j = tl.program_id(1)
    r, kvh, offs_g, offs_n, offs_d, d_ok, q = _program_rows(Q, Hkv, G, stride_qr, stride_qh, stride_qd, HEAD_DIM,
                                                          BLOCK_D, BLOCK_G, BLOCK_SIZE)
    g_ok = offs_g < G
    s, valid, _ = _block_scores(q, K, TABLE, VALID, r, kvh, j, stride_kb, stride_kh, stride_kn, stride_kd,
                                stride_tr, stride_mr, stride_mh, qk_scale, offs_n, offs_d, d_ok, BLOCK_SIZE)
    lse = tl.load(LSE + r * (Hkv * G) + kvh * G + offs_g, mask=g_ok, other=0.0)
    p = tl.where(g_ok[:, None] & valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
    tl.store(COLSUM + (r * Hkv + kvh) * NUM_BLOCKS * BLOCK_SIZE + j * BLOCK_SIZE + offs_n, tl.sum(p, 0) / G)


def _common(query: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, valid: torch.Tensor):
    rows, q_heads, dim = query.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"the paged Triton kernels need a power-of-two block size, got {block_size}")
    if valid.shape != (rows, kv_heads, table.shape[1] * block_size):
        raise ValueError(f"valid must be [requests, KV heads, blocks x block size], got {tuple(valid.shape)}")
    constants = {"HEAD_DIM": dim, "BLOCK_D": triton.next_power_of_2(dim),
                 "BLOCK_G": max(2, triton.next_power_of_2(q_heads // kv_heads)), "BLOCK_SIZE": block_size}
    return (valid.to(torch.uint8).contiguous(), table.to(torch.int32).contiguous(), constants,
            (kv_heads, q_heads // kv_heads, table.shape[1]))


def paged_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 valid: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per request, ``query`` [R, Hq, D], over the blocks ``table`` [R, nblk] of ``keys``/
    ``values`` [blocks, Hkv, block_size, D] (any strides: the halves of vLLM's slots too), where ``valid``
    [R, Hkv, nblk * block_size] holds a token. Returns (output [R, Hq, D] in the query's dtype, base-2 log-sum-exp
    [R, Hq] fp32). A request's row with no valid slot gives NaN."""
    valid_u8, table_i32, constants, (kv_heads, groups, blocks) = _common(query, keys, table, valid)
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(query.shape[0] * kv_heads,)](
        query, keys, values, table_i32, valid_u8, out, lse,
        *query.stride(), *keys.stride(), *values.stride(), table_i32.stride(0), valid_u8.stride(0),
        valid_u8.stride(1), *out.stride(), kv_heads, groups, blocks, scaling * LOG2E, **constants,
    )
    return out.to(query.dtype), lse


def paged_column_sums(query: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, valid: torch.Tensor,
                      lse: torch.Tensor, scaling: float) -> torch.Tensor:
    """The score pass: ``exp2(q.k * scale * log2(e) - lse)`` of every valid slot, summed over nothing (one query)
    and averaged over each KV head's G query heads: [R, Hkv, nblk * block_size] fp32 (0 where no token).
    ``lse`` [R, Hq] is base 2, from `paged_decode` or any kernel that returns one for the same logits."""
    valid_u8, table_i32, constants, (kv_heads, groups, blocks) = _common(query, keys, table, valid)
    colsum = torch.empty(valid.shape, dtype=torch.float32, device=query.device)
    _paged_scores_kernel[(query.shape[0] * kv_heads, blocks)](
        query, keys, table_i32, valid_u8, lse.float().contiguous(), colsum,
        *query.stride(), *keys.stride(), table_i32.stride(0), valid_u8.stride(0), valid_u8.stride(1),
        kv_heads, groups, blocks, scaling * LOG2E, **constants,
    )
    return colsum


@triton.jit
def _move_slots_kernel(K, V, SRC_BLOCK, SRC_OFFSET, DST_BLOCK, DST_OFFSET, HEAD, stride_kb, stride_kh, stride_kn,
                       stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    src_block = tl.load(SRC_BLOCK + i).to(tl.int64)
    src_offset = tl.load(SRC_OFFSET + i).to(tl.int64)
    dst_block = tl.load(DST_BLOCK + i).to(tl.int64)
    dst_offset = tl.load(DST_OFFSET + i).to(tl.int64)
    head = tl.load(HEAD + i).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_dim = d < HEAD_DIM
    key = tl.load(K + src_block * stride_kb + head * stride_kh + src_offset * stride_kn + d * stride_kd, mask=in_dim)
    value = tl.load(V + src_block * stride_vb + head * stride_vh + src_offset * stride_vn + d * stride_vd,
                    mask=in_dim)
    tl.store(K + dst_block * stride_kb + head * stride_kh + dst_offset * stride_kn + d * stride_kd, key, mask=in_dim)
    tl.store(V + dst_block * stride_vb + head * stride_vh + dst_offset * stride_vn + d * stride_vd, value,
             mask=in_dim)


def move_slots(keys: torch.Tensor, values: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor],
               target: tuple[torch.Tensor, torch.Tensor], head: torch.Tensor) -> None:
    """The compaction: for each i, KV head ``head[i]``'s key and value at (block, offset) ``source`` move to
    ``target``, in ``keys``/``values`` [blocks, Hkv, block_size, D] of any strides (vLLM's cache as it lies). One
    program per moved slot; the sources and targets of one compaction are distinct slots, so no program reads
    what another writes."""
    count = head.numel()
    if count == 0:
        return
    ids = [t.to(device=keys.device, dtype=torch.int64).contiguous() for t in (*source, *target, head)]
    dim = keys.shape[-1]
    _move_slots_kernel[(count,)](keys, values, *ids, *keys.stride(), *values.stride(), HEAD_DIM=dim,
                                 BLOCK_D=triton.next_power_of_2(dim))
