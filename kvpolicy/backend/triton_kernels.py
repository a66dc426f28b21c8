"""Attention with score tracking in Triton: the GPU path, same contract as `torch_ref.attend_tracking`.

Two kernel families, both reading the cache's storage in place (no K/V copy, no
``repeat_kv``, never a T x T matrix):

* decode (``G * q <= 16`` rows per KV head: one or a few queries per sequence): a
  split-K kernel folds the G query heads of a KV head into the rows of one tile, walks
  its share of the key slots with an online softmax and writes partial (max, sum, acc)
  plus the raw logits of its slots (``[B, Hkv, G*q, T]`` fp32, i.e. O(G*q*T), small next
  to K/V); a finishing kernel merges the splits' (max, sum) into each row's log-sum-exp,
  merges the partial outputs, and turns ``exp(logit - lse)`` into the column statistics
  (two launches in all).
* prefill (any number of queries): a flash-style forward (one program per block of
  queries of one query head, KV head = query head // G) gives the output, the
  log-sum-exp per query and the number of keys each query sees; a second kernel owns a
  block of key slots per (batch row, KV head), keeps those keys in registers and walks
  the query blocks that can see them (the causal half is skipped), recomputing
  ``exp(q.k * scale - lse)`` tile by tile and reducing over queries and the G query
  heads in registers: each statistic is written once, without atomics (deterministic).

Visibility of key slot j to query i: ``valid[b, h, j] and key_positions[b, h, j] <=
query_positions[b, i]`` (and ``> query_positions[b, i] - sliding_window`` when given).
As in the cache, new queries sit at slots ``past_slots + i``, so slots past
``past_slots + i`` are never visible to query i: whole key blocks past a query block's
last slot are skipped (this is also what the torch reference assumes).

Numerics: logits and probabilities are fp32; fp16/bf16 inputs go into ``tl.dot`` as they
are on a GPU (exact products, fp32 accumulation) and P is cast to the value dtype for
P @ V as FlashAttention does; fp32 inputs use IEEE fp32 dots (no TF32). Under
``TRITON_INTERPRET=1`` everything is upcast to fp32 before ``tl.dot`` (the interpreter's
bf16 dot is wrong). Triton picks compile-or-interpret when it is first imported, so
``TRITON_INTERPRET=1`` must be set before anything imports triton.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..policies.base import AttentionStats
from . import torch_ref
from .call import AttentionCall, AttentionResult
from .sdpa_lse import causal_attention_with_lse
from .select import interpreting
from .triton_tuning import (
    DECODE_SPACE,
    DECODE_SPLIT_MULTIPLE,
    FORWARD_SPACE,
    STATS_SPACE,
    autotuning,
    length_bucket,
    tuned,
)

LOG2E = 1.4426950408889634
#: the decode path is taken when the G query heads times the queries of a call fit one tile of rows
DECODE_MAX_ROWS = 16
#: tests only: feed fp16 to ``tl.dot`` as the GPU path does, even under the interpreter (its fp16 dot is right)
NATIVE_DOT_UNDER_INTERPRETER = False


# --------------------------------------------------------------------------------------------------
# prefill: flash forward with log-sum-exp, then per-key-block statistics
# --------------------------------------------------------------------------------------------------
@triton.jit
def _visible_scores(
    q, k_base, valid_base, pos_base, cols, n_ok, offs_d, d_ok, stride_kn, stride_kd, stride_mn, stride_pn,
    qpos, window, qk_scale, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    """Scaled logits of the queries against one block of key slots (-inf where not visible), and visibility."""
    kt = tl.load(
        k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
        mask=n_ok[None, :] & d_ok[:, None], other=0.0,
    )
    kval = tl.load(valid_base + cols * stride_mn, mask=n_ok, other=0) != 0
    kpos = tl.load(pos_base + cols * stride_pn, mask=n_ok, other=0)
    vis = kval[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_WINDOW:
        vis = vis & (kpos[None, :] > qpos[:, None] - window)
    if UPCAST:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return tl.where(vis, s * qk_scale, float("-inf")), vis


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v_base, cols, n_ok, offs_d, d_ok, stride_vn, stride_vd, UPCAST: tl.constexpr):
    """Fold one block of base-2 logits and its values into the running max, normaliser and output."""
    v = tl.load(
        v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
        mask=n_ok[:, None] & d_ok[None, :], other=0.0,
    )
    return _fold_block(s, v, m_i, l_i, acc, UPCAST)


@triton.jit
def _fold_block(s, v, m_i, l_i, acc, UPCAST: tl.constexpr):
    """`_online_softmax_step` on values already loaded (fp32 when UPCAST, else P is cast to their dtype)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _empty_running(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split's running (max, normaliser, visible count, output) before its first block."""
    return (tl.full([BLOCK_R], float("-inf"), tl.float32), tl.zeros([BLOCK_R], tl.float32),
            tl.zeros([BLOCK_R], tl.float32), tl.zeros([BLOCK_R, BLOCK_D], tl.float32))


@triton.jit
def _prefill_fwd_kernel(
    Q, K, V, KVALID, KPOS, QPOS, OUT, LSE, CNT,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mn,
    stride_pb, stride_ph, stride_pn,
    stride_qpb, stride_qpm,
    stride_ob, stride_om, stride_oh, stride_od,
    Hq, Hkv, G, QLEN, T, past_slots, window, qk_scale, T_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, WANT_CNT: tl.constexpr,
):
    # T_BUCKET (unused here): the autotuner's key, a power-of-two bucket of the length
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    kvh = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < QLEN
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = tl.load(QPOS + b * stride_qpb + offs_m * stride_qpm, mask=m_ok, other=-1)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    valid_base = KVALID + b * stride_mb + kvh * stride_mh
    pos_base = KPOS + b * stride_pb + kvh * stride_ph

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the block's last query sits at slot past_slots + (pid_m + 1) * BLOCK_M - 1
    hi = tl.minimum(T, past_slots + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < hi
        s, vis = _visible_scores(
            q, k_base, valid_base, pos_base, cols, n_ok, offs_d, d_ok, stride_kn, stride_kd, stride_mn, stride_pn,
            qpos, window, qk_scale, HAS_WINDOW, UPCAST,
        )
        m_i, l_i, acc = _online_softmax_step(
            s, m_i, l_i, acc, v_base, cols, n_ok, offs_d, d_ok, stride_vn, stride_vd, UPCAST
        )
        if WANT_CNT:
            cnt += tl.sum(vis.to(tl.float32), 1)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # a query that sees no key (a pad) gets 0, as in the reference
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("inf"))
    o_ptrs = OUT + b * stride_ob + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (b * Hq + h) * QLEN + offs_m, lse, mask=m_ok)
    if WANT_CNT:
        if h % G == 0:  # every query head of the KV head counts the same keys
            tl.store(CNT + (b * Hkv + kvh) * QLEN + offs_m, cnt, mask=m_ok)


@triton.jit
def _prefill_stats_kernel(
    Q, K, KVALID, KPOS, QPOS, QVALID, LSE, CNT, COLSUM, COLSUM_SQ, BELOW, ROWS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mn,
    stride_pb, stride_ph, stride_pn,
    stride_qpb, stride_qpm,
    stride_qvb, stride_qvm,
    Hq, Hkv, G, QLEN, T, past_slots, window, qk_scale, inv_g, W, T_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, HAS_QVALID: tl.constexpr,
    WANT_SUM: tl.constexpr, WANT_SQ: tl.constexpr, WANT_BELOW: tl.constexpr, WANT_ROWS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = cols < T
    d_ok = offs_d < HEAD_DIM

    # this program's keys stay in registers while it walks the queries that can see them
    kt = tl.load(
        K + b * stride_kb + kvh * stride_kh + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
        mask=n_ok[None, :] & d_ok[:, None], other=0.0,
    )
    if UPCAST:
        kt = kt.to(tl.float32)
    kval = tl.load(KVALID + b * stride_mb + kvh * stride_mh + cols * stride_mn, mask=n_ok, other=0) != 0
    kpos = tl.load(KPOS + b * stride_pb + kvh * stride_ph + cols * stride_pn, mask=n_ok, other=0)

    colsum = tl.zeros([BLOCK_N], tl.float32)
    colsum_sq = tl.zeros([BLOCK_N], tl.float32)
    below = tl.zeros([BLOCK_N], tl.float32)
    # query i sits at slot past_slots + i: queries before the block's first slot never see it
    q_lo = tl.maximum(pid_n * BLOCK_N - past_slots, 0)
    if not (WANT_SUM or WANT_SQ or WANT_BELOW):
        q_lo = tl.maximum(q_lo, QLEN - W)  # only the last W rows are wanted
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    rows_base = ROWS + (b * Hkv + kvh) * W * T
    for g in range(0, G):
        h = kvh * G + g
        q_base = Q + b * stride_qb + h * stride_qh
        for start_m in range(q_lo, QLEN, BLOCK_M):
            rows = start_m + offs_m
            m_ok = rows < QLEN
            q = tl.load(
                q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0,
            )
            qpos = tl.load(QPOS + b * stride_qpb + rows * stride_qpm, mask=m_ok, other=-1)
            lse = tl.load(LSE + (b * Hq + h) * QLEN + rows, mask=m_ok, other=float("inf"))
            if HAS_QVALID:
                real = m_ok & (tl.load(QVALID + b * stride_qvb + rows * stride_qvm, mask=m_ok, other=0) != 0)
            else:
                real = m_ok
            if UPCAST:
                s = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            vis = kval[None, :] & (kpos[None, :] <= qpos[:, None]) & real[:, None]
            if HAS_WINDOW:
                vis = vis & (kpos[None, :] > qpos[:, None] - window)
            p = tl.where(vis, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            if WANT_SUM:
                colsum += tl.sum(p, 0)
            if WANT_SQ:
                colsum_sq += tl.sum(p * p, 0)
            if WANT_BELOW:
                cnt = tl.load(CNT + (b * Hkv + kvh) * QLEN + rows, mask=m_ok, other=1.0)
                below += tl.sum(tl.where(vis & (p * cnt[:, None] < 1.0), 1.0, 0.0), 0)
            if WANT_ROWS:
                if start_m + BLOCK_M > QLEN - W:
                    w = rows - (QLEN - W)
                    r_ptrs = rows_base + w[:, None] * T + cols[None, :]
                    r_mask = (w >= 0)[:, None] & m_ok[:, None] & n_ok[None, :]
                    # this program alone owns these columns: a plain read-modify-write
                    old = tl.load(r_ptrs, mask=r_mask, other=0.0)
                    tl.store(r_ptrs, old + p * inv_g, mask=r_mask)
    out = (b * Hkv + kvh) * T + cols
    if WANT_SUM:
        tl.store(COLSUM + out, colsum * inv_g, mask=n_ok)
    if WANT_SQ:
        tl.store(COLSUM_SQ + out, colsum_sq * inv_g, mask=n_ok)
    if WANT_BELOW:
        tl.store(BELOW + out, below * inv_g, mask=n_ok)


# --------------------------------------------------------------------------------------------------
# decode: split-K over the key slots with the G query heads (times the few queries) as tile rows
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode_rows(Q, QPOS, pid_bh, Hkv, G, R, stride_qb, stride_qh, stride_qm, stride_qd, stride_qpb, stride_qpm,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """A decode program's rows: the G query heads (times the queries) of one (batch row, KV head), query-major (row r
    is query r // G of query head kvh * G + r % G); their queries as stored, and positions."""
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < R
    d_ok = offs_d < HEAD_DIM
    qi = offs_r // G
    h = kvh * G + offs_r % G
    q = tl.load(
        Q + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=r_ok[:, None] & d_ok[None, :], other=0.0,
    )
    qpos = tl.load(QPOS + b * stride_qpb + qi * stride_qpm, mask=r_ok, other=-1)
    return b, kvh, offs_r, offs_d, r_ok, d_ok, q, qpos


@triton.jit
def _store_partials(M_PART, L_PART, C_PART, ACC_PART, pid_bh, split, NUM_SPLITS, m_i, l_i, cnt, acc,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One split's running (max, sum, visible count, output) of its rows, for the finishing kernel to merge."""
    offs_r = tl.arange(0, BLOCK_R)
    part = (pid_bh.to(tl.int64) * NUM_SPLITS + split) * BLOCK_R + offs_r
    tl.store(M_PART + part, m_i)
    tl.store(L_PART + part, l_i)
    tl.store(C_PART + part, cnt)
    tl.store(ACC_PART + part[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc)


@triton.jit
def _decode_partial_kernel(
    Q, K, V, KVALID, KPOS, QPOS, S, M_PART, L_PART, C_PART, ACC_PART,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mn,
    stride_pb, stride_ph, stride_pn,
    stride_qpb, stride_qpm,
    Hkv, G, R, T_EFF, window, qk_scale, split_len, NUM_SPLITS, T_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, STORE_S: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, kvh, offs_r, offs_d, r_ok, d_ok, q, qpos = _decode_rows(
        Q, QPOS, pid_bh, Hkv, G, R, stride_qb, stride_qh, stride_qm, stride_qd, stride_qpb, stride_qpm,
        HEAD_DIM, BLOCK_D, BLOCK_R,
    )
    offs_n = tl.arange(0, BLOCK_N)
    if UPCAST:
        q = q.to(tl.float32)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    valid_base = KVALID + b * stride_mb + kvh * stride_mh
    pos_base = KPOS + b * stride_pb + kvh * stride_ph
    s_base = S + pid_bh.to(tl.int64) * R * T_EFF

    m_i, l_i, cnt, acc = _empty_running(BLOCK_R, BLOCK_D)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, T_EFF)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < hi
        s, vis = _visible_scores(
            q, k_base, valid_base, pos_base, cols, n_ok, offs_d, d_ok, stride_kn, stride_kd, stride_mn, stride_pn,
            qpos, window, qk_scale, HAS_WINDOW, UPCAST,
        )
        if STORE_S:
            tl.store(s_base + offs_r[:, None] * T_EFF + cols[None, :], s, mask=r_ok[:, None] & n_ok[None, :])
        m_i, l_i, acc = _online_softmax_step(
            s, m_i, l_i, acc, v_base, cols, n_ok, offs_d, d_ok, stride_vn, stride_vd, UPCAST
        )
        cnt += tl.sum(vis.to(tl.float32), 1)

    _store_partials(M_PART, L_PART, C_PART, ACC_PART, pid_bh, pid_s, NUM_SPLITS, m_i, l_i, cnt, acc, BLOCK_R, BLOCK_D)


@triton.jit
def _decode_finish_kernel(
    M_PART, L_PART, C_PART, ACC_PART, S, QVALID, OUT, COLSUM, COLSUM_SQ, BELOW, ROWS,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_qvb, stride_qvm,
    Hkv, G, QLEN, R, T, T_EFF, W, inv_g, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_QVALID: tl.constexpr, BLOCK_W: tl.constexpr,
    WANT_SUM: tl.constexpr, WANT_SQ: tl.constexpr, WANT_BELOW: tl.constexpr, WANT_ROWS: tl.constexpr,
):
    """Merge the splits' (max, sum) into each row's log-sum-exp; program 0 of a (row, KV head) also
    merges the partial outputs; every program turns its block of logits into the statistics."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    kvh = pid_bh % Hkv
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    cnt = tl.zeros([BLOCK_R], tl.float32)
    for split in range(0, NUM_SPLITS):
        part = (pid_bh.to(tl.int64) * NUM_SPLITS + split) * BLOCK_R + offs_r
        m_s = tl.load(M_PART + part)
        l_s = tl.load(L_PART + part)
        cnt += tl.load(C_PART + part)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + l_s * tl.exp2(m_s - m_safe)
        m_i = m_new
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("inf"))
    qi = offs_r // G  # rows are query-major: row r is query r // G of query head kvh * G + r % G

    if pid_n == 0:
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for split in range(0, NUM_SPLITS):
            part = (pid_bh.to(tl.int64) * NUM_SPLITS + split) * BLOCK_R + offs_r
            weight = tl.exp2(tl.load(M_PART + part) - tl.where(seen, lse, 0.0))  # exp(m_s - lse), 0 if unseen
            acc += tl.load(ACC_PART + part[:, None] * BLOCK_D + offs_d[None, :]) * weight[:, None]
        h = kvh * G + offs_r % G
        o_ptrs = OUT + b * stride_ob + qi[:, None] * stride_om + h[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :])

    if WANT_SUM or WANT_SQ or WANT_BELOW or WANT_ROWS:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < T_EFF
        s = tl.load(
            S + pid_bh.to(tl.int64) * R * T_EFF + offs_r[:, None] * T_EFF + cols[None, :],
            mask=r_ok[:, None] & n_ok[None, :], other=float("-inf"),
        )
        vis = s > float("-inf")
        if HAS_QVALID:
            vis = vis & (tl.load(QVALID + b * stride_qvb + qi * stride_qvm, mask=r_ok, other=0) != 0)[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        out = pid_bh.to(tl.int64) * T + cols
        if WANT_SUM:
            tl.store(COLSUM + out, tl.sum(p, 0) * inv_g, mask=n_ok)
        if WANT_SQ:
            tl.store(COLSUM_SQ + out, tl.sum(p * p, 0) * inv_g, mask=n_ok)
        if WANT_BELOW:
            below = tl.where(vis & (p * cnt[:, None] < 1.0), 1.0, 0.0)
            tl.store(BELOW + out, tl.sum(below, 0) * inv_g, mask=n_ok)
        if WANT_ROWS:
            # the last W queries' rows, each the mean of its G query heads' rows
            offs_w = tl.arange(0, BLOCK_W)
            w_of_row = qi - (QLEN - W)
            pick = tl.where(w_of_row[None, :] == offs_w[:, None], inv_g, 0.0)  # [BLOCK_W, BLOCK_R]
            last = tl.sum(pick[:, :, None] * p[None, :, :], 1)  # [BLOCK_W, BLOCK_N]
            r_ptrs = ROWS + (pid_bh.to(tl.int64) * W + offs_w[:, None]) * T + cols[None, :]
            tl.store(r_ptrs, last, mask=(offs_w < W)[:, None] & n_ok[None, :])


# the same kernels under triton.autotune, for the GPU (`triton_tuning`: the spaces, and why the keys)
_decode_partial_tuned = tuned(_decode_partial_kernel, DECODE_SPACE, {"dec_n": "BLOCK_N"}, "dec_warps", "dec_stages",
                              key=["HEAD_DIM", "BLOCK_R", "T_BUCKET", "UPCAST", "STORE_S", "HAS_WINDOW"])
_prefill_fwd_tuned = tuned(_prefill_fwd_kernel, FORWARD_SPACE, {"fwd_m": "BLOCK_M", "fwd_n": "BLOCK_N"}, "fwd_warps",
                           "fwd_stages", key=["HEAD_DIM", "T_BUCKET", "UPCAST", "WANT_CNT", "HAS_WINDOW"])
_prefill_stats_tuned = tuned(_prefill_stats_kernel, STATS_SPACE, {"stats_m": "BLOCK_M", "stats_n": "BLOCK_N"},
                             "stats_warps", "stats_stages",
                             key=["HEAD_DIM", "T_BUCKET", "UPCAST", "HAS_QVALID", "WANT_SUM", "WANT_SQ", "WANT_BELOW",
                                  "WANT_ROWS"],
                             reset_to_zero=["ROWS"])  # it adds into ROWS: each timed run starts from zeros


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _configs(head_dim: int, interpret: bool) -> dict[str, int]:
    """Tile sizes: tiny under the interpreter (so short test sequences span several blocks)."""
    if interpret:
        return dict(fwd_m=16, fwd_n=16, fwd_warps=4, fwd_stages=1, stats_m=16, stats_n=16, stats_warps=4,
                    stats_stages=1, dec_n=16, dec_warps=4, dec_stages=1, finish_n=16)
    big = head_dim > 64
    return dict(
        fwd_m=128, fwd_n=64 if big else 128, fwd_warps=8, fwd_stages=3 if big else 2,
        stats_m=64, stats_n=128 if not big else 64, stats_warps=8, stats_stages=2,
        dec_n=64 if big else 128, dec_warps=4, dec_stages=3, finish_n=128,
    )


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(batch_heads: int, keys: int, block: int, interpret: bool, device: torch.device) -> int:
    """Key splits per (batch row, KV head) for decode: enough programs to fill the GPU."""
    blocks = triton.cdiv(max(keys, 1), block)
    if interpret:
        return min(2, blocks)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(blocks, triton.cdiv(2 * sms, batch_heads)))


def _launch(tune: bool, kernel, tuned_kernel, grid, args: tuple, constants: dict, fixed: dict) -> None:
    """``kernel`` on ``grid(meta)`` with ``fixed`` block sizes, warps and stages, or ``tuned_kernel`` choosing them."""
    if tune:
        tuned_kernel[grid](*args, **constants)
    else:
        kernel[grid(fixed)](*args, **constants, **fixed)


def _as_u8(mask: torch.Tensor) -> torch.Tensor:
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


#: statistics only the torch reference computes (read at the prompt alone: FastGen's profile, a probe's maxima)
TORCH_ONLY_STATS = frozenset({"colsum_heads", "near_colsum_heads", "colmax"})


_warned_key_bias = False


def _warn_key_bias() -> None:
    global _warned_key_bias
    if not _warned_key_bias:
        warnings.warn("kvpolicy: the Triton kernels take no key bias yet, so layers whose merged tokens attend in "
                      "proportion to what they stand for (proportional_attention) run the torch path on the GPU",
                      stacklevel=4)
        _warned_key_bias = True


def attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    """One layer's attention call, as `torch_ref.attend`: the kernels when statistics are asked for.

    Calls without statistics run SDPA (the fastest exact kernel there is), and the profiling
    statistics and a key bias (`AttentionCall.key_bias`), which have no kernel, run on the torch reference on the
    same device. A tiered
    layer's decode steps go to `triton_tiered.attend` (`dispatch`); its other calls come here and
    decode the layer first.
    """
    call = call.decoded()  # a tiered layer's call that `triton_tiered` did not take: its K/V decoded
    if call.key_bias is not None:
        _warn_key_bias()
        return torch_ref.attend(query, call)
    if not call.needs or call.needs & TORCH_ONLY_STATS:
        return torch_ref.attend(query, call)
    query = call.prepare_query(query)
    out, stats = attend_tracking_triton(
        query, call.keys, call.values, call.valid, call.key_positions, call.query_positions, call.scaling,
        call.needs, call.query_valid, call.past_slots, call.last_rows_window, call.sliding_window,
        causal_only=call.causal_only,
    )
    return AttentionResult(out, stats)


def attend_tracking_triton(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    needs: frozenset[str],
    query_valid: torch.Tensor | None,
    past_slots: int,
    last_rows: int = 0,
    sliding_window: int | None = None,
    *,
    mode: str = "auto",
    causal_only: bool = False,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """Attention output [B, q, Hq, D] (query dtype) plus the requested fp32 statistics over the T slots.

    ``query`` [B, Hq, q, D]; ``keys``/``values`` [B, Hkv, T, D] (views into the cache are fine);
    ``valid`` [B, Hkv, T] bool; ``key_positions`` [B, Hkv, T] int64 (or int32); ``query_positions`` [B, q]
    int64 (-1 for pads); ``query_valid`` [B, q] bool or None (all real). Statistics are those of
    `torch_ref.attend_tracking`: summed over the call's real queries, mean over the G query
    heads of each KV head; only the ones named in ``needs`` are computed (others are None).
    ``mode`` forces the "decode" or "prefill" kernels, or "prefill_sdpa" (tests); "auto" picks decode when
    ``G * q <= DECODE_MAX_ROWS``, else for a fresh causal prompt (``causal_only``: every slot valid, no pads, no
    window; and no past slots) PyTorch's fused attention for the output and its log-sum-exp (`sdpa_lse`), then
    the statistics pass, else the prefill kernels. ``config``: block sizes, warps and stages by hand (keys of
    `_configs`, an entry of a `triton_tuning` space); else autotuned on a GPU, fixed under the interpreter.
    """
    batch, q_heads, queries, dim = query.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if values.shape[:3] != keys.shape[:3] or values.shape[-1] != dim or keys.shape[-1] != dim:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match query {tuple(query.shape)}")
    if valid.shape != keys.shape[:3] or key_positions.shape != keys.shape[:3]:
        raise ValueError("valid and key_positions must be [B, Hkv, T] like keys")
    groups = q_heads // kv_heads
    device = query.device
    interpret = interpreting()
    if device.type != "cuda" and not interpret:
        raise RuntimeError("the Triton backend needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    native = not interpret or (NATIVE_DOT_UNDER_INTERPRETER and query.dtype == torch.float16)
    upcast = not native or torch.float32 in (query.dtype, keys.dtype, values.dtype)
    cfg = {**_configs(dim, interpret), **(config or {})}
    tune = not interpret and config is None and autotuning()
    block_d = max(16, triton.next_power_of_2(dim))
    qk_scale = float(scaling) * LOG2E
    window = int(sliding_window) if sliding_window is not None else 0
    has_window = sliding_window is not None
    valid_u8 = _as_u8(valid)
    query_positions = query_positions.to(device=device, dtype=torch.long)
    key_positions = key_positions if key_positions.dtype == torch.long else key_positions.long()
    qvalid_u8 = _as_u8(query_valid.to(device)) if query_valid is not None else None

    f32 = dict(dtype=torch.float32, device=device)
    rows = groups * queries
    use_decode = mode == "decode" or (mode == "auto" and rows <= DECODE_MAX_ROWS)
    if mode not in ("auto", "decode", "prefill", "prefill_sdpa"):
        raise ValueError(f"mode must be auto, decode, prefill or prefill_sdpa, not {mode!r}")
    fresh_prompt = causal_only and past_slots == 0 and total == queries and query_valid is None and not sliding_window
    if mode == "prefill_sdpa" and not fresh_prompt:
        raise ValueError("prefill_sdpa needs a fresh causal prompt: causal_only, no past slots, no pads, no window")
    fused = None
    if not use_decode and fresh_prompt and mode in ("auto", "prefill_sdpa"):
        fused = causal_attention_with_lse(query, keys, values, scaling)
    t_eff = min(total, past_slots + queries)  # slots past the last query's own are never visible
    # prefill adds each query head's share of the last rows in place
    buffers = StatBuffers.allocate(needs, last_rows, queries, (batch, kv_heads, total), t_eff, device,
                                   rows_zeroed=not use_decode)
    any_stats, below = buffers.any, buffers.below
    dummy = torch.empty(1, **f32)
    out = torch.empty(batch, queries, q_heads, dim, dtype=query.dtype, device=device)

    qs = query.stride()
    ks, vs, ms, ps = keys.stride(), values.stride(), valid_u8.stride(), key_positions.stride()
    qps = query_positions.stride()
    os_ = out.stride()
    qvs = qvalid_u8.stride() if qvalid_u8 is not None else (0, 0)
    qv_arg = qvalid_u8 if qvalid_u8 is not None else dummy
    stat_args, flags = buffers.args(dummy), buffers.flags()

    if use_decode:
        block_r = max(16, triton.next_power_of_2(rows))
        multiple = DECODE_SPLIT_MULTIPLE if tune else cfg["dec_n"]  # a split never ends inside a block
        splits = _num_splits(batch * kv_heads, t_eff, multiple, interpret, device)
        split_len = triton.cdiv(triton.cdiv(max(t_eff, 1), splits), multiple) * multiple
        splits = triton.cdiv(max(t_eff, 1), split_len)
        scores = torch.empty(batch * kv_heads, rows, t_eff, **f32) if any_stats else dummy
        m_part = torch.empty(batch * kv_heads, splits, block_r, **f32)
        l_part, c_part = torch.empty_like(m_part), torch.empty_like(m_part)
        acc_part = torch.empty(batch * kv_heads, splits, block_r, block_d, **f32)
        _launch(
            tune, _decode_partial_kernel, _decode_partial_tuned, lambda meta: (splits, batch * kv_heads),
            (query, keys, values, valid_u8, key_positions, query_positions, scores, m_part, l_part, c_part, acc_part,
             *qs, *ks, *vs, *ms, *ps, *qps,
             kv_heads, groups, rows, t_eff, window, qk_scale, split_len, splits, length_bucket(t_eff)),
            dict(HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_R=block_r, HAS_WINDOW=has_window, UPCAST=upcast,
                 STORE_S=any_stats),
            dict(BLOCK_N=cfg["dec_n"], num_warps=cfg["dec_warps"], num_stages=cfg["dec_stages"]),
        )
        finish_decode((m_part, l_part, c_part, acc_part), scores, qvalid_u8, out, buffers, groups, total, t_eff, splits,
                      block_r, cfg["finish_n"], dummy)
    else:
        if fused is not None:  # the output and log-sum-exp of the fused kernel; only the statistics pass is ours
            fused_out, lse = fused
            out.copy_(fused_out)
            lse = lse.contiguous()
            cnt = dummy
            if below is not None:  # query i of a fresh causal prompt sees keys 0..i
                cnt = torch.arange(1, queries + 1, **f32).expand(batch, kv_heads, queries).contiguous()
        else:
            lse = torch.empty(batch, q_heads, queries, **f32)
            cnt = torch.empty(batch, kv_heads, queries, **f32) if below is not None else dummy
            _launch(
                tune, _prefill_fwd_kernel, _prefill_fwd_tuned,
                lambda meta: (triton.cdiv(queries, meta["BLOCK_M"]), batch * q_heads),
                (query, keys, values, valid_u8, key_positions, query_positions, out, lse, cnt,
                 *qs, *ks, *vs, *ms, *ps, *qps, *os_,
                 q_heads, kv_heads, groups, queries, total, past_slots, window, qk_scale, length_bucket(total)),
                dict(HEAD_DIM=dim, BLOCK_D=block_d, HAS_WINDOW=has_window, UPCAST=upcast, WANT_CNT=below is not None),
                dict(BLOCK_M=cfg["fwd_m"], BLOCK_N=cfg["fwd_n"], num_warps=cfg["fwd_warps"],
                     num_stages=cfg["fwd_stages"]),
            )
        if any_stats:
            _launch(
                tune, _prefill_stats_kernel, _prefill_stats_tuned,
                lambda meta: (triton.cdiv(total, meta["BLOCK_N"]), batch * kv_heads),
                (query, keys, valid_u8, key_positions, query_positions, qv_arg, lse, cnt, *stat_args,
                 *qs, *ks, *ms, *ps, *qps, *qvs,
                 q_heads, kv_heads, groups, queries, total, past_slots, window, qk_scale, 1.0 / groups,
                 max(buffers.rows_w, 1), length_bucket(total)),
                dict(HEAD_DIM=dim, BLOCK_D=block_d, HAS_WINDOW=has_window, UPCAST=upcast,
                     HAS_QVALID=qvalid_u8 is not None, **flags),
                dict(BLOCK_M=cfg["stats_m"], BLOCK_N=cfg["stats_n"], num_warps=cfg["stats_warps"],
                     num_stages=cfg["stats_stages"]),
            )

    return out, buffers.stats(query_valid, batch, queries, device)


@dataclass
class StatBuffers:
    """The fp32 statistics a call asked for, [B, Hkv, T] (``rows_out`` [B, Hkv, W, T]), None where not asked."""

    colsum: torch.Tensor | None
    colsum_sq: torch.Tensor | None
    below: torch.Tensor | None
    rows_out: torch.Tensor | None
    rows_w: int  # the last rows returned (W)

    @classmethod
    def allocate(cls, needs: frozenset[str], last_rows: int, queries: int, shape: tuple[int, int, int], t_eff: int,
                 device: torch.device, rows_zeroed: bool = False) -> StatBuffers:
        # the kernels write every column they can see: zero-fill only what they leave (or accumulate into)
        fill = torch.zeros if t_eff < shape[2] else torch.empty
        f32 = dict(dtype=torch.float32, device=device)
        rows_w = min(last_rows, queries) if "last_rows" in needs and last_rows > 0 else 0
        return cls(
            fill(*shape, **f32) if "colsum" in needs else None,
            fill(*shape, **f32) if "colsum_sq" in needs else None,
            fill(*shape, **f32) if "below_uniform" in needs else None,
            (torch.zeros if rows_zeroed else fill)(shape[0], shape[1], rows_w, shape[2], **f32) if rows_w else None,
            rows_w,
        )

    @property
    def any(self) -> bool:
        return any(t is not None for t in (self.colsum, self.colsum_sq, self.below, self.rows_out))

    def args(self, dummy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t if t is not None else dummy for t in (self.colsum, self.colsum_sq, self.below, self.rows_out))

    def flags(self) -> dict[str, bool]:
        return dict(WANT_SUM=self.colsum is not None, WANT_SQ=self.colsum_sq is not None,
                    WANT_BELOW=self.below is not None, WANT_ROWS=self.rows_out is not None)

    def stats(self, query_valid: torch.Tensor | None, batch: int, queries: int, device: torch.device) -> AttentionStats:
        if query_valid is not None:
            real = query_valid.to(device).sum(dim=1)
        else:
            real = torch.full((batch,), queries, dtype=torch.long, device=device)
        return AttentionStats(queries=real, colsum=self.colsum, colsum_sq=self.colsum_sq, below_uniform=self.below,
                              last_rows=self.rows_out)


def finish_decode(parts: tuple[torch.Tensor, ...], scores: torch.Tensor, qvalid_u8: torch.Tensor | None,
                  out: torch.Tensor, buffers: StatBuffers, groups: int, total: int, t_eff: int, splits: int,
                  block_r: int, finish_n: int, dummy: torch.Tensor) -> None:
    """Merge a decode call's ``splits`` partial (max, sum, count, acc) into ``out`` [B, q, Hq, D], and its logits
    ``scores`` [B * Hkv, G * q, t_eff] into the statistics over the ``total`` slots."""
    batch, queries, q_heads, dim = out.shape
    kv_heads = q_heads // groups
    block_n = min(finish_n, max(16, triton.next_power_of_2(t_eff))) if buffers.any else 16
    _decode_finish_kernel[(triton.cdiv(t_eff, block_n) if buffers.any else 1, batch * kv_heads)](
        *parts, scores, qvalid_u8 if qvalid_u8 is not None else dummy, out, *buffers.args(dummy), *out.stride(),
        *(qvalid_u8.stride() if qvalid_u8 is not None else (0, 0)),
        kv_heads, groups, queries, groups * queries, total, t_eff, max(buffers.rows_w, 1), 1.0 / groups, splits,
        HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_R=block_r, BLOCK_N=block_n,
        HAS_QVALID=qvalid_u8 is not None, BLOCK_W=max(2, triton.next_power_of_2(max(buffers.rows_w, 1))),
        **buffers.flags(), num_warps=4,
    )
