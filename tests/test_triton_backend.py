"""The Triton score-tracking kernels equal the torch reference (CPU, Triton's interpreter).

Triton decides between compiling and interpreting when it is first imported, so
``TRITON_INTERPRET=1`` is set here before anything imports triton. If something in the
same pytest run imported triton earlier without it, the kernel tests re-run this file in
a subprocess instead (see `test_rerun_in_subprocess`).

On a GPU, ``KVPOLICY_TEST_DEVICE=cuda`` runs the same cases compiled on the device
(`benchmarks/gpu_check.sh` does so); the interpreter is then left off.

Tolerances (the same fp32 math on the same rounded inputs, so tight for every dtype):
statistics atol/rtol 2e-5 (``below_uniform``: counts / G, equal up to rounding); output
fp32 1e-5, fp16 2e-3 (1 ulp of the fp16 result), bf16 1e-2 / 1.6e-2 (1 ulp of bf16).
Under the interpreter fp16/bf16 are upcast before ``tl.dot``; the GPU's native fp16 dot
path (P cast to the value dtype for P @ V) is covered by one fp16 case.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_ORIGINAL_INTERPRET = os.environ.get("TRITON_INTERPRET")
DEVICE = os.environ.get("KVPOLICY_TEST_DEVICE", "cpu")
ON_GPU = DEVICE.startswith("cuda")
# triton imported earlier in this process without the interpreter cannot run kernels on CPU
_TRITON_PREIMPORTED = "triton" in sys.modules and _ORIGINAL_INTERPRET != "1" and not ON_GPU
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kvpolicy.backend import torch_ref  # noqa: E402
from kvpolicy.backend.select import select_backend  # noqa: E402
from kvpolicy.errors import KVPolicyError  # noqa: E402

in_process = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1; see test_rerun_in_subprocess"
)

ALL_STATS = frozenset({"colsum", "colsum_sq", "below_uniform", "last_rows"})
STAT_TOL = dict(atol=2e-5, rtol=2e-5)
OUT_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
}
if ON_GPU:
    # compiled fp16/bf16 dots round P to the value dtype before P @ V (the reference keeps fp32), and
    # the GPU's exp2 / accumulation order differ from the CPU's in the last bits
    STAT_TOL = dict(atol=1e-4, rtol=1e-4)
    OUT_TOL = {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=4e-3, rtol=4e-3),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_env():
    yield
    if _ORIGINAL_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _ORIGINAL_INTERPRET


def make_case(
    *, batch=2, kv_heads=2, groups=3, past=36, queries=1, dim=64, dtype=torch.float32, pads=0,
    ragged=True, trailing=0, seed=0,
):
    """Inputs laid out as `PolicyLayer` holds them after ``update`` + ``begin_attention``.

    Past slots hold a random subset of earlier real tokens per (row, head) at arbitrary slots
    (as after eviction), empty slots invalid with position -1; row 0 of the new tokens starts
    with ``pads`` left pads (invalid, position -1, query_valid False); ``trailing`` empty slots
    follow the new tokens (storage capacity beyond the slots in use).
    """
    gen = torch.Generator().manual_seed(seed)
    total = past + queries + trailing
    query = torch.randn(batch, kv_heads * groups, queries, dim, generator=gen).to(dtype)
    keys = (torch.randn(batch, kv_heads, total, dim, generator=gen) * 1.5).to(dtype)
    values = torch.randn(batch, kv_heads, total, dim, generator=gen).to(dtype)
    seen = past + 5  # real tokens seen before this call: more than the past slots (some were evicted)
    positions = torch.full((batch, kv_heads, total), -1, dtype=torch.long)
    valid = torch.zeros(batch, kv_heads, total, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            keep = torch.randperm(seen, generator=gen)[:past]
            positions[b, h, :past] = keep
            valid[b, h, :past] = torch.rand(past, generator=gen) > 0.3 if ragged else True
    positions[:, :, :past].masked_fill_(~valid[:, :, :past], -1)
    query_valid = torch.ones(batch, queries, dtype=torch.bool)
    query_valid[0, :pads] = False
    ranks = torch.cumsum(query_valid.long(), dim=1) - 1
    query_positions = torch.where(query_valid, seen + ranks, -1)
    positions[:, :, past : past + queries] = query_positions[:, None, :]
    valid[:, :, past : past + queries] = query_valid[:, None, :]
    case = dict(
        query=query, keys=keys, values=values, valid=valid, key_positions=positions,
        query_positions=query_positions, query_valid=query_valid if pads else None, past_slots=past,
    )
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in case.items()}


def reference(case, needs, last_rows, sliding_window=None, packed=False):
    valid, positions, query_positions = case["valid"], case["key_positions"], case["query_positions"]

    def mask_for(lo, hi, width):  # what attach.py builds from PolicyLayer.key_mask
        key_pos = positions[:, :, None, :width]
        query_pos = query_positions[:, lo:hi][:, None, :, None]
        mask = valid[:, :, None, :width] & (key_pos <= query_pos)
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        return mask

    query = case["query"]
    return torch_ref.attend_tracking(
        query, case["keys"], case["values"], None if packed else mask_for, query.shape[-1] ** -0.5, needs,
        case["query_valid"], case["past_slots"], last_rows,
    )


def triton_run(case, needs, last_rows, sliding_window=None, mode="auto", causal_only=False, config=None):
    from kvpolicy.backend.triton_kernels import attend_tracking_triton

    query = case["query"]
    return attend_tracking_triton(
        query, case["keys"], case["values"], case["valid"], case["key_positions"], case["query_positions"],
        query.shape[-1] ** -0.5, needs, case["query_valid"], case["past_slots"], last_rows, sliding_window,
        mode=mode, causal_only=causal_only, config=config,
    )


def check(case, needs=ALL_STATS, last_rows=3, sliding_window=None, modes=("decode", "prefill"), packed=False,
          stat_tol=None, config=None):
    ref_out, ref = reference(case, needs, last_rows, sliding_window, packed)
    dtype = case["query"].dtype
    for mode in modes:
        out, stats = triton_run(case, needs, last_rows, sliding_window, mode, causal_only=mode == "prefill_sdpa",
                                config=config)
        assert out.dtype == dtype and out.shape == ref_out.shape, mode
        torch.testing.assert_close(
            out.float(), ref_out.float(), **OUT_TOL[dtype], msg=lambda m, mode=mode: f"{mode} output: {m}"
        )
        assert torch.equal(stats.queries, ref.queries), mode
        for name in ("colsum", "colsum_sq", "below_uniform", "last_rows"):
            mine = getattr(stats, name)
            if name not in needs or (name == "last_rows" and last_rows == 0):
                assert mine is None, (mode, name)
                continue
            theirs = getattr(ref, name)
            assert mine.dtype == torch.float32 and mine.shape == theirs.shape, (mode, name)
            if name == "below_uniform" and (ON_GPU or mode == "prefill_sdpa"):
                assert_counts_close(mine, theirs, case, mode)
                continue
            torch.testing.assert_close(
                mine, theirs, **(stat_tol or STAT_TOL), msg=lambda m, mode=mode, name=name: f"{mode} {name}: {m}"
            )


def assert_counts_close(mine, theirs, case, mode):
    """below_uniform on a GPU, or rebuilt from SDPA's log-sum-exp: a probability within rounding of 1/n may fall
    on either side of it (SDPA's own exp/sum order differs from the reference's in the last bits).

    Such a flip moves one (query, query head) count by 1/G; allow it on at most 5% of the tokens."""
    groups = case["query"].shape[1] // case["keys"].shape[1]
    diff = (mine - theirs).abs()
    assert float(diff.max()) <= 1 / groups + 1e-5, f"{mode} below_uniform: {float(diff.max())} > 1/G"
    assert float((diff > 1e-5).float().mean()) <= 0.05, f"{mode} below_uniform: too many flips"


# --- kernels against the reference ------------------------------------------------------------------
def distinct_blocks(space: list[dict], block_keys: tuple[str, ...]) -> list[dict]:
    """One entry per distinct block-size combination (under the interpreter warps and stages change nothing)."""
    seen: dict[tuple, dict] = {}
    for entry in space:
        seen.setdefault(tuple(entry[k] for k in block_keys), entry)
    return list(seen.values())


def _tuning_spaces():
    from kvpolicy.backend.triton_tuning import DECODE_SPACE, FORWARD_SPACE, STATS_SPACE

    decode = distinct_blocks(DECODE_SPACE, ("dec_n",))
    forward = distinct_blocks(FORWARD_SPACE, ("fwd_m", "fwd_n"))
    stats = distinct_blocks(STATS_SPACE, ("stats_m", "stats_n"))
    prefill = [{**forward[i % len(forward)], **stats[i % len(stats)]} for i in range(max(len(forward), len(stats)))]
    return decode, prefill


DECODE_BLOCKS, PREFILL_BLOCKS = _tuning_spaces()


@in_process
@pytest.mark.parametrize("entry", DECODE_BLOCKS, ids=lambda e: f"n{e['dec_n']}")
def test_every_decode_block_of_the_tuning_space(entry):
    """Each block size the autotuner may pick, with the key slots split across programs, equals the reference."""
    check(make_case(groups=4, past=150, queries=1, seed=5), modes=("decode",), config=entry)


@in_process
@pytest.mark.parametrize("entry", PREFILL_BLOCKS, ids=lambda e: f"m{e['fwd_m']}n{e['fwd_n']}-m{e['stats_m']}n{e['stats_n']}")
def test_every_prefill_block_of_the_tuning_spaces(entry):
    check(make_case(groups=2, past=20, queries=70, pads=3, seed=6), modes=("prefill",), config=entry)


def fresh_prompt(groups, dtype=torch.float32, queries=40, dim=64):
    """A prompt's first call: every slot one of its queries, all valid, no pads (what SDPA's causal mask covers)."""
    return make_case(past=0, queries=queries, groups=groups, dtype=dtype, dim=dim, seed=groups)


@in_process
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_from_fused_attention_and_its_log_sum_exp(groups, dtype):
    """The output and log-sum-exp of PyTorch's fused attention, then the statistics pass, equal the reference.

    In half precision the fused kernel's log-sum-exp comes from its own rounding of the logits (the statistics
    pass and the reference take exact fp32 products): probabilities agree to a relative 1e-4, not 2e-5."""
    tol = None if dtype == torch.float32 else dict(atol=2e-4, rtol=1e-4)
    check(fresh_prompt(groups, dtype), modes=("prefill_sdpa",), packed=True, stat_tol=tol)


@in_process
@pytest.mark.parametrize(("needs", "last_rows"), [(frozenset({"last_rows"}), 8), (frozenset({"colsum"}), 0),
                                                  (frozenset({"below_uniform", "last_rows"}), 4)])
def test_fresh_prompt_statistics_a_policy_reads_only(needs, last_rows):
    check(fresh_prompt(2, queries=56), needs, last_rows, modes=("prefill_sdpa",), packed=True)


@in_process
def test_auto_mode_takes_fused_attention_for_a_fresh_prompt_only(monkeypatch):
    from kvpolicy.backend import triton_kernels

    calls = []
    real = triton_kernels.causal_attention_with_lse
    monkeypatch.setattr(triton_kernels, "causal_attention_with_lse", lambda *a: calls.append(1) or real(*a))
    case = fresh_prompt(3)
    triton_run(case, ALL_STATS, 3, causal_only=True)
    assert calls == [1]
    triton_run(case, ALL_STATS, 3, causal_only=False)  # a call the layer did not vouch for: the own kernels
    triton_run(make_case(past=20, queries=24), ALL_STATS, 3, causal_only=True)  # past slots: not a fresh prompt
    assert calls == [1]
    with pytest.raises(ValueError, match="fresh causal prompt"):
        triton_run(make_case(past=20, queries=24), ALL_STATS, 3, mode="prefill_sdpa")


@in_process
@pytest.mark.parametrize("groups", [1, 3, 4])
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_step(groups, dim):
    """One query per row over 36 past slots (37 keys: not a multiple of the 16-slot block), ragged heads."""
    check(make_case(groups=groups, dim=dim, past=36, queries=1, seed=groups * dim))


@in_process
@pytest.mark.parametrize("groups,dim,queries", [(1, 128, 7), (3, 64, 37), (4, 128, 7)])
def test_prefill_left_padded(groups, dim, queries):
    """A fresh causal prompt (past_slots=0) whose row 0 starts with 3 pads."""
    check(make_case(groups=groups, dim=dim, past=0, queries=queries, pads=3, ragged=False, seed=queries))


@in_process
@pytest.mark.parametrize("groups", [3, 4])
def test_chunk_with_past_ragged_and_pads(groups):
    """A 5-query chunk over a ragged, evicted past (e.g. chunked prefill), pads in row 0."""
    check(make_case(groups=groups, dim=64, past=32, queries=5, pads=2, seed=7))


@in_process
def test_single_key():
    """T = 1: the first token of a prompt."""
    check(make_case(groups=3, dim=64, past=0, queries=1, ragged=False))


@in_process
def test_head_and_row_with_no_visible_key():
    """A head whose every slot is empty and a pad query: output 0 and no statistics, no NaN.

    Also 3 empty slots after the new tokens (T > past_slots + q): their statistics are 0."""
    case = make_case(groups=3, dim=64, past=20, queries=5, pads=5, trailing=3, seed=3)
    case["valid"][1, 0] = False
    case["key_positions"][1, 0] = -1
    check(case)


@in_process
def test_pad_queries_add_nothing_even_where_they_see_keys():
    """query_valid False is what silences a query's statistics (its output is free to be anything)."""
    case = make_case(groups=3, dim=64, past=20, queries=5, seed=14)
    case["query_valid"] = torch.tensor([[False, True, True, False, True], [True] * 5], device=DEVICE)
    needs = ALL_STATS
    _, ref = reference(case, needs, 5)
    for mode in ("decode", "prefill"):
        _, stats = triton_run(case, needs, 5, mode=mode)
        assert torch.equal(stats.queries, ref.queries)
        for name in ("colsum", "colsum_sq", "below_uniform", "last_rows"):
            if name == "below_uniform" and ON_GPU:
                assert_counts_close(stats.below_uniform, ref.below_uniform, case, mode)
                continue
            torch.testing.assert_close(
                getattr(stats, name), getattr(ref, name), **STAT_TOL,
                msg=lambda m, mode=mode, name=name: f"{mode} {name}: {m}",
            )


@in_process
def test_packed_cache_matches_reference_fast_paths():
    """No pads and every slot valid: the reference's mask-free (and decode-step) paths."""
    decode = make_case(groups=4, dim=64, past=36, queries=1, ragged=False, seed=11)
    check(decode, needs=frozenset({"colsum", "last_rows"}), last_rows=1, packed=True)
    prompt = make_case(groups=4, dim=64, past=0, queries=21, ragged=False, seed=12)
    check(prompt, packed=True, modes=("prefill",))


@in_process
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """fp16/bf16 storage, fp32 statistics; decode and a left-padded prompt."""
    check(make_case(groups=4, dim=128, past=36, queries=1, dtype=dtype, seed=5))
    check(make_case(groups=3, dim=64, past=0, queries=37, pads=3, ragged=False, dtype=dtype, seed=6))


@in_process
def test_native_fp16_dot_path(monkeypatch):
    """The GPU path: fp16 straight into tl.dot, P cast to fp16 for P @ V (the interpreter's fp16 dot is exact)."""
    from kvpolicy.backend import triton_kernels

    monkeypatch.setattr(triton_kernels, "NATIVE_DOT_UNDER_INTERPRETER", True)
    check(make_case(groups=3, dim=64, past=20, queries=5, pads=2, dtype=torch.float16, seed=8))


@in_process
def test_sliding_window():
    check(make_case(groups=3, dim=64, past=30, queries=5, pads=1, seed=9), sliding_window=9)


@in_process
@pytest.mark.parametrize(
    "needs,last_rows",
    [(frozenset({"colsum"}), 0), (frozenset({"last_rows"}), 2), (frozenset({"below_uniform", "last_rows"}), 8)],
)
def test_subsets_of_statistics(needs, last_rows):
    """Only the asked-for statistics are computed; a last_rows window wider than the call is clipped."""
    check(make_case(groups=3, dim=64, past=10, queries=5, pads=1, seed=10), needs=needs, last_rows=last_rows)


@in_process
def test_auto_mode_picks_by_rows():
    """auto: decode kernels for G*q <= 16 rows, prefill kernels beyond; both equal the reference."""
    from kvpolicy.backend import triton_kernels

    calls = []
    for name in ("_decode_partial_kernel", "_prefill_fwd_kernel"):
        kernel = getattr(triton_kernels, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                calls.append(self.name)
                return self.kernel[grid]

        setattr(triton_kernels, name, Spy(kernel, name))
    try:
        check(make_case(groups=4, dim=64, past=20, queries=4, seed=13), modes=("auto",))
        check(make_case(groups=4, dim=64, past=20, queries=5, seed=13), modes=("auto",))
    finally:
        for name in ("_decode_partial_kernel", "_prefill_fwd_kernel"):
            setattr(triton_kernels, name, getattr(triton_kernels, name).kernel)
    assert calls == ["_decode_partial_kernel", "_prefill_fwd_kernel"]


# --- end to end on a tiny model -------------------------------------------------------------------
def greedy_keeping(model, plan, ids, mask, steps):
    """Greedy tokens, logits and each step's kept positions of every layer, with ``plan`` attached for the run."""
    from helpers import StepRecorder, greedy

    from kvpolicy.hf.session import attach

    session = attach(model, plan)
    layers = range(model.config.num_hidden_layers)
    recorder = StepRecorder(lambda: {i: session.last_cache.kept_positions(i) for i in layers})
    try:
        tokens, logits = greedy(session.model, ids, mask, steps, recorder=recorder, cache=session.new_cache())
    finally:
        session.detach()
    return tokens, logits, recorder.steps


@in_process
def test_tiny_llama_h2o_same_kept_tokens_and_greedy_output(monkeypatch):
    from helpers import uniform_plan
    from tiny_models import padded_batch, tiny_model

    from kvpolicy.backend.triton_kernels import attend_tracking_triton
    from kvpolicy.recipe.budget import Budget

    model = tiny_model("llama").to(DEVICE)  # 6 query heads over 2 KV heads (G=3), head dim 16
    ids, mask = (tensor.to(DEVICE) for tensor in padded_batch(lengths=(17, 12, 9)))
    monkeypatch.setenv("KVPOLICY_BACKEND", "torch")  # the reference run (auto would pick triton on a GPU)
    steps = 8
    layers = range(model.config.num_hidden_layers)

    def run():
        return greedy_keeping(model, uniform_plan(model, "h2o", Budget(tokens=7), recent_ratio=0.5), ids, mask, steps)

    ref_tokens, ref_logits, ref_kept = run()

    calls = []
    from kvpolicy.backend import triton_kernels

    def counting(query, *args, **kwargs):
        calls.append(query.shape[2])
        return attend_tracking_triton(query, *args, **kwargs)

    monkeypatch.setattr(triton_kernels, "attend_tracking_triton", counting)
    monkeypatch.setenv("KVPOLICY_BACKEND", "triton")  # the real selection path in attach()
    tokens, logits, kept = run()

    assert len(calls) == len(layers) * steps and calls[0] == ids.shape[1]
    assert kept == ref_kept
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@in_process
def test_proportional_merging_falls_back_to_the_torch_path_with_one_warning(monkeypatch):
    """D2O with proportional attention: its merged slots' key bias has no kernel, so those calls run the torch path
    on the same device, saying so once; what is kept and generated equals the torch backend's."""
    from helpers import uniform_plan
    from tiny_models import padded_batch, tiny_model

    from kvpolicy.backend import triton_kernels
    from kvpolicy.recipe.budget import Budget

    model = tiny_model("llama").to(DEVICE)
    ids, mask = (tensor.to(DEVICE) for tensor in padded_batch(lengths=(17, 12, 9)))

    def run():
        plan = uniform_plan(model, "d2o", Budget(tokens=6), layer_budgets=False, keep_mass=True, proportional=True)
        return greedy_keeping(model, plan, ids, mask, 4)

    monkeypatch.setenv("KVPOLICY_BACKEND", "torch")
    ref_tokens, ref_logits, ref_kept = run()
    monkeypatch.setenv("KVPOLICY_BACKEND", "triton")
    monkeypatch.setattr(triton_kernels, "_warned_key_bias", False)
    with pytest.warns(UserWarning, match="take no key bias yet") as warned:
        tokens, logits, kept = run()
    assert len([w for w in warned if "key bias" in str(w.message)]) == 1
    assert kept == ref_kept and torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@in_process
def test_tiny_llama_tiered_h2o_same_kept_tokens_and_greedy_output_reading_codes_in_place(monkeypatch, tmp_path):
    """A byte budget over 16/8/2-bit tiers: the Triton run's decode steps read the codes in place and keep what the
    torch run keeps, with the same tokens."""
    from tiny_models import padded_batch, tiny_model

    from kvpolicy.backend import triton_tiered
    from kvpolicy.recipe import load_recipe

    model = tiny_model("llama").to(DEVICE)
    ids, mask = (tensor.to(DEVICE) for tensor in padded_batch(lengths=(44, 40)))
    path = tmp_path / "tiered.yaml"
    path.write_text("kvpolicy: 1\npolicy: h2o\nbudget: {memory: 0.6, slack: 2, tiers: [{bits: 16, share: 0.4}, "
                    "{bits: 8, share: 0.3}, {bits: 2}]}\n")
    steps = 5
    layers = range(model.config.num_hidden_layers)

    def run():
        return greedy_keeping(model, load_recipe(str(path)), ids, mask, steps)

    monkeypatch.setenv("KVPOLICY_BACKEND", "torch")
    ref_tokens, ref_logits, ref_kept = run()
    calls = []
    real = triton_tiered.attend_tiered_decode

    def counting(query, regions, *args, **kwargs):
        calls.append([region.bits for region in regions if region.count])
        return real(query, regions, *args, **kwargs)

    monkeypatch.setattr(triton_tiered, "attend_tiered_decode", counting)
    monkeypatch.setenv("KVPOLICY_BACKEND", "triton")
    tokens, logits, kept = run()
    assert len(calls) == len(layers) * (steps - 1)  # every decode step of every layer; the prompt decodes the layer
    assert any(2 in bits and 8 in bits for bits in calls)  # codes of both quantized tiers were read in place
    assert kept == ref_kept
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


# --- backend selection -----------------------------------------------------------------------------
def test_select_backend(monkeypatch):
    monkeypatch.delenv("KVPOLICY_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert select_backend(None, cpu) == "torch"
    assert select_backend("auto", cpu) == "torch"
    assert select_backend("torch", torch.device("cuda")) == "torch"
    assert select_backend("auto", torch.device("cuda")) == "triton"  # triton imports here
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("triton", cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(KVPolicyError, match="CUDA GPU.*backend: torch or auto.*TRITON_INTERPRET=1"):
            select_backend("triton", cpu)
        with pytest.raises(KVPolicyError, match="no CUDA device"):
            select_backend("triton", None)
    with pytest.raises(KVPolicyError, match='unknown backend .*did you mean "triton"'):
        select_backend("trition", cpu)


def test_select_backend_environment_overrides_the_recipe(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KVPOLICY_BACKEND", "torch")
    assert select_backend("triton", torch.device("cpu")) == "torch"
    monkeypatch.setenv("KVPOLICY_BACKEND", "triton")
    assert select_backend("torch", torch.device("cpu"), use_env=False) == "torch"
    if not torch.cuda.is_available():
        with pytest.raises(KVPolicyError, match="environment variable KVPOLICY_BACKEND.*unset KVPOLICY_BACKEND"):
            select_backend("torch", torch.device("cpu"))
    monkeypatch.setenv("KVPOLICY_BACKEND", "")
    assert select_backend("torch", torch.device("cpu")) == "torch"


# --- tiered layers: codes de-quantized in registers (`triton_tiered`) ------------------------------
THREE_TIERS = "[{{bits: 16, share: 0.4}}, {{bits: 8, share: 0.3, keys: {keys}}}, {{bits: 2, keys: {keys}}}]"
TWO_TIERS = "[{{bits: 16, share: 0.5}}, {{bits: 4, keys: {keys}, group: 16}}]"


def tiered_layer(tmp_path, keys: str, tiers: str, seed: int = 0):
    """A layer of a tiny Llama after a prompt and decoding under an H2O byte budget with ``tiers`` (evictions, tokens
    moved down a tier), built by the torch backend."""
    import textwrap

    from tiny_models import VOCAB, tiny_model

    from kvpolicy.hf.session import attach
    from kvpolicy.recipe import load_recipe

    model = tiny_model("llama", seed=seed).to(DEVICE)
    path = tmp_path / "tiered.yaml"
    path.write_text("kvpolicy: 1\n" + textwrap.dedent(f"""\
        policy: h2o
        budget: {{memory: 0.5, slack: 3, tiers: {tiers.format(keys=keys)}}}
        """))
    session = attach(model, load_recipe(str(path)))
    ids = torch.randint(1, VOCAB, (2, 70), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    cache = session.new_cache(prompt_tokens=40)
    with torch.inference_mode():
        model(input_ids=ids[:, :40], cache=cache, use_cache=True)
        for index in range(40, 70):
            model(input_ids=ids[:, index : index + 1], cache=cache, use_cache=True)
    return cache.layers[1]


@in_process
@pytest.mark.parametrize("keys, tiers", [
    ("channel", THREE_TIERS), ("cell", TWO_TIERS), ("token", THREE_TIERS), ("channel", TWO_TIERS)])
def test_tiered_decode_reads_codes_in_place_and_equals_the_reference(tmp_path, monkeypatch, keys, tiers):
    """The kernel over the tiers' codes gives the torch reference's output and statistics on the decoded layer."""
    from kvpolicy.backend.triton_tiered import attend_tiered_decode

    monkeypatch.setenv("KVPOLICY_BACKEND", "torch")
    layer = tiered_layer(tmp_path, keys, tiers)
    store = layer.store
    regions = store.kernel_regions()
    assert [r.bits for r in regions] == [t.bits for t in reversed(store.tiers)]
    assert sum(r.count for r in regions[:-1]) > 0, "nothing was quantized: the case tests nothing"
    keys_now, values_now = store.attention_kv()
    used = keys_now.shape[2]
    positions = layer.positions[:, :, :used].long()
    # holes, as a quantized region keeps between moves (this layer's tiers happen to be full)
    holes = torch.rand(layer.valid[:, :, :used].shape, generator=torch.Generator().manual_seed(1)) > 0.2
    valid = layer.valid[:, :, :used] & holes.to(DEVICE)
    batch, kv_heads, _, dim = keys_now.shape
    for groups, queries in ((3, 1), (3, 2)):
        gen = torch.Generator().manual_seed(groups * 10 + queries)
        query = torch.randn(batch, kv_heads * groups, queries, dim, generator=gen).to(DEVICE)
        query_positions = int(positions.max()) + 1 + torch.arange(queries, device=DEVICE).expand(batch, queries)
        case = dict(query=query, keys=keys_now.float(), values=values_now.float(), valid=valid,
                    key_positions=positions, query_positions=query_positions, query_valid=None,
                    past_slots=used - queries)
        ref_out, ref_stats = reference(case, ALL_STATS, last_rows=queries)
        out, stats = attend_tiered_decode(query, regions, valid, positions, query_positions, dim**-0.5, ALL_STATS,
                                          None, used - queries, last_rows=queries)
        torch.testing.assert_close(out, ref_out, **OUT_TOL[torch.float32])
        for name in ("colsum", "colsum_sq", "last_rows"):
            torch.testing.assert_close(getattr(stats, name), getattr(ref_stats, name), **STAT_TOL)
        assert_counts_close(stats.below_uniform, ref_stats.below_uniform, case, "decode")


# --- the GPU benchmark's logic, at toy sizes --------------------------------------------------------
@in_process
@pytest.mark.skipif(ON_GPU, reason="the benchmark itself runs on the GPU")
def test_gpu_benchmark_interpret_smoke():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_attention.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--interpret-smoke"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "decode" in done.stdout and "prefill" in done.stdout


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="ran in process")
def test_rerun_in_subprocess():
    """triton was imported without the interpreter before this module: run the kernel tests in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=900,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 20, done.stdout[-2000:]  # the kernel tests really ran there
