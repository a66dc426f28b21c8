"""Serving under a fixed KV memory in vLLM: the full cache against kvpolicy recipes, in one run.

Requests of different lengths arrive together; each configuration gets the same number of KV blocks
(``--kv-blocks``, vLLM's ``num_gpu_blocks_override``). Per configuration: the most requests running at once,
KV blocks held (peak and mean), decode tokens/s (steps that only decode), end-to-end tokens/s, time to first
token; then the cost of kvpolicy's attention per decode step against vLLM's own CPU kernel at the same context.
Writes a table, ``vllm_capacity.jsonl`` and ``vllm_capacity.png`` into ``--out``.

Run it with the vLLM environment's Python (tests/vllm/make_venv.sh builds one), or through
``kvpolicy bench --engine vllm``, which starts it there:

    .venv-vllm/bin/python -m kvpolicy.integrations.vllm.capacity --recipes full h2o streaming --requests 8 \\
        --prompt-tokens 1500 --new-tokens 256 --kv-blocks 138
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler is read in this process

DEFAULT_MODEL = Path(os.environ.get("KVPOLICY_CACHE", Path.home() / ".cache" / "kvpolicy")) / "smollm2-135m-instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a local Hugging Face folder (default: the embedded SmolLM2, as kvpolicy caches it)")
    parser.add_argument("--recipes", nargs="+", default=["full", "h2o", "streaming"],
                        help="`full` is vLLM without kvpolicy; others are kvpolicy recipes (names or YAML paths)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="mean prompt length (spread +-20%%)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-blocks", type=int, default=0,
                        help="KV blocks for every configuration (default: 2.5 full-cache requests' worth)")
    parser.add_argument("--kv-memory", help="KV memory instead of --kv-blocks, e.g. 64MiB (vLLM's kv_cache_memory_bytes)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="tokens per engine step (vLLM's max_num_batched_tokens): long prompts come in chunks of "
                             "at most this many (default: vLLM's own)")
    parser.add_argument("--evict-during-prefill", action="store_true",
                        help="recipes evict between a prompt's chunks (the entry's evict_during_prefill)")
    parser.add_argument("--preemption", nargs="+", default=["never"], choices=["never", "recompute"],
                        help="the recipes' admission (the entry's `preemption`): `never` admits a request only when "
                             "its most blocks are free, so vLLM never preempts; `recompute` is vLLM's own, the full "
                             "cache's, which may preempt. Two values run each recipe under both")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="every prompt starts with the same this many tokens (a system prompt), then its own text")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="vLLM's prefix caching on for every configuration (recipes that read no attention "
                             "statistics run with it; the table then counts cached blocks and prompt tokens reused)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks that split the model's KV heads (vLLM's tensor_parallel_size); on vLLM's CPU "
                             "build each rank gets its share of the cores (VLLM_CPU_OMP_THREADS_BIND, unless set)")
    parser.add_argument("--load-format", default="auto",
                        help="vLLM's load_format: `dummy` gives random weights of the model's shape (a folder with its "
                             "config and tokenizer only, e.g. on a machine without the weights)")
    parser.add_argument("--compiled", action="store_true",
                        help="vLLM's compiled mode, as it serves by default (default here: eager, enforce_eager; "
                             "compiling takes ~100 s per engine on a 2-core CPU)")
    parser.add_argument("--text", type=Path, help="the prompts' text (default: CPython's pydoc_data.topics)")
    parser.add_argument("--kernel-repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs") / f"vllm-capacity-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a local model folder (the embedded SmolLM2 "
                     "is cached there by any `kvpolicy` command, e.g. `kvpolicy compare --tasks ppl --tokens 50`)")
    for name in ("requests", "prompt_tokens", "new_tokens", "block_size", "kernel_repeats", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.shared_prefix_tokens < round(0.8 * args.prompt_tokens):
        parser.error("--shared-prefix-tokens must be >= 0 and below the shortest prompt (0.8 x --prompt-tokens)")
    if args.prefill_chunk < 0:
        parser.error("--prefill-chunk must be >= 0")
    if args.kv_blocks < 0:
        parser.error("--kv-blocks must be >= 0")
    if args.kv_memory is not None:
        try:
            args.kv_memory = memory_bytes(args.kv_memory)
        except ValueError:
            parser.error(f"--kv-memory {args.kv_memory!r}: give bytes with an optional unit, e.g. 64MiB or 1GiB")
    return args


def memory_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    number = text.strip().lower().rstrip("abgikm")
    unit = text.strip().lower()[len(number):]
    if unit not in units or float(number) <= 0:
        raise ValueError(text)
    return int(float(number) * units[unit])


def prompt_ids(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    if args.text is not None:
        text = args.text.read_text(encoding="utf-8", errors="replace")
    else:
        import pydoc_data.topics

        text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text)["input_ids"]
    lengths = [round(args.prompt_tokens * (0.8 + 0.4 * i / max(1, args.requests - 1))) for i in range(args.requests)]
    if max(lengths) > len(ids):
        raise SystemExit(f"the text has {len(ids)} tokens; prompts of {max(lengths)} need more (--text)")
    stride = max(1, (len(ids) - max(lengths)) // args.requests)
    shared = ids[: args.shared_prefix_tokens]  # the text's start, before any prompt's own part (which starts later)
    own = [ids[len(shared) + i * stride: len(shared) + i * stride + length - len(shared)]
           for i, length in enumerate(lengths)]
    return [shared + part for part in own]


def block_bytes(args: argparse.Namespace) -> int:
    """K/V bytes of one KV block of every layer of ``args.model`` at ``args.dtype`` (vLLM's page size, all layers)."""
    config = json.loads((args.model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * args.block_size * dtype_bytes


def bind_cores(ranks: int) -> None:
    """vLLM's CPU build runs several ranks only with their cores given (it refuses for lack of NUMA nodes on a
    machine with one): an even share each, unless VLLM_CPU_OMP_THREADS_BIND says otherwise."""
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // ranks)
        spans = [cores[r * share: (r + 1) * share] or cores[-1:] for r in range(ranks)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{span[0]}-{span[-1]}" if len(span) > 1 else f"{span[0]}" for span in spans)


def run_config(recipe: str, prompts: list[list[int]], args: argparse.Namespace, blocks: int,
               preemption: str = "never") -> dict:
    from vllm import LLM, SamplingParams

    engine_args = {"dtype": args.dtype, "enforce_eager": not args.compiled, "enable_prefix_caching": args.prefix_caching,
                   "block_size": args.block_size,
                   "max_model_len": max(map(len, prompts)) + args.new_tokens + args.block_size,
                   "max_num_seqs": len(prompts), "disable_log_stats": True,
                   "tensor_parallel_size": args.tensor_parallel_size, "load_format": args.load_format}
    if args.kv_memory is not None:
        engine_args["kv_cache_memory_bytes"] = args.kv_memory
    else:
        # the bytes of exactly these blocks: without a size, vLLM's CPU worker asks for a share of the NUMA node's RAM
        # less this process's resident memory, which a second engine in the same process can exceed on a small node
        engine_args.update(num_gpu_blocks_override=blocks, kv_cache_memory_bytes=(blocks + 1) * block_bytes(args))
    if args.prefill_chunk:
        engine_args["max_num_batched_tokens"] = args.prefill_chunk
    if recipe != "full":
        engine_args["additional_config"] = {"kvpolicy": {"recipe": recipe, "preemption": preemption,
                                                         "evict_during_prefill": args.evict_during_prefill}}
    llm = LLM(model=str(args.model), **engine_args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    steps: list[dict] = []
    original = scheduler.schedule

    def schedule(*a, **kw):
        output = original(*a, **kw)
        prefill = any(scheduler.requests[rid].num_computed_tokens - n < scheduler.requests[rid].num_prompt_tokens
                      for rid, n in output.num_scheduled_tokens.items() if rid in scheduler.requests)
        steps.append({"running": len(scheduler.running), "prefill": prefill,
                      "tokens": output.total_num_scheduled_tokens,
                      "blocks": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
                      # free blocks that still hold a prefix-cache entry (vLLM's LRU hands them out last)
                      "cached": sum(1 for block in pool.blocks if block.ref_cnt == 0 and block.block_hash is not None)
                      if args.prefix_caching else 0})
        return output

    scheduler.schedule = schedule
    preempted = []
    original_preempt = scheduler._preempt_request

    def preempt(request, *a, **kw):
        preempted.append(request.request_id)
        return original_preempt(request, *a, **kw)

    scheduler._preempt_request = preempt
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": ids}, params)
    first_token: dict[str, float] = {}
    reused: dict[str, int] = {}  # prompt tokens each request found in the prefix cache
    finished: dict[str, float] = {}
    generated: dict[str, int] = {}
    step_times = []
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        new_tokens = 0
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            new_tokens += count - generated.get(out.request_id, 0)
            generated[out.request_id] = count
            if count and out.request_id not in first_token:
                first_token[out.request_id] = now - start
                reused[out.request_id] = out.num_cached_tokens or 0
            if out.finished:
                finished[out.request_id] = now - start
        step_times.append((now - before, new_tokens))
    total = time.perf_counter() - start
    scheduler.schedule, scheduler._preempt_request = original, original_preempt
    del llm
    records = steps[: len(step_times)]
    decode = [(seconds, tokens) for (seconds, tokens), step in zip(step_times, records, strict=True)
              if not step["prefill"] and tokens]
    decode_seconds = sum(s for s, _ in decode)
    return {
        "config": recipe if recipe == "full" or preemption == "never" else f"{recipe} ({preemption})",
        "preemption": "recompute" if recipe == "full" else preemption, "preemptions": len(preempted),
        "requests": len(prompts), "kv_blocks": pool.num_gpu_blocks - 1,  # less the null block
        "block_size": args.block_size, "prefill_chunk": args.prefill_chunk or None,
        "tensor_parallel_size": args.tensor_parallel_size, "compiled": args.compiled,
        "evict_during_prefill": args.evict_during_prefill and recipe != "full",
        "peak_running": max(step["running"] for step in records),
        "peak_blocks": max(step["blocks"] for step in records),
        "mean_blocks": round(statistics.mean(step["blocks"] for step in records), 1),
        "prefix_caching": args.prefix_caching, "shared_prefix_tokens": args.shared_prefix_tokens,
        "mean_cached_blocks": round(statistics.mean(step["cached"] for step in records), 1),
        "prompt_tokens_reused": sum(reused.values()), "prompt_tokens": sum(map(len, prompts)),
        "cached_per_step": [step["cached"] for step in records],
        "decode_tokens_per_s": round(sum(t for _, t in decode) / decode_seconds, 2) if decode_seconds else None,
        "end_to_end_tokens_per_s": round(sum(generated.values()) / total, 2),
        "ttft_median_s": round(statistics.median(first_token.values()), 2),
        "ttft_max_s": round(max(first_token.values()), 2),
        "seconds": round(total, 1), "generated": sum(generated.values()),
        "running_per_step": [step["running"] for step in records],
        "blocks_per_step": [step["blocks"] for step in records],
        # which steps count as decode-only (no prompt chunk in them), with their seconds and new tokens
        "prefill_per_step": [step["prefill"] for step in records],
        "seconds_per_step": [round(seconds, 4) for seconds, _ in step_times],
        "tokens_per_step": [tokens for _, tokens in step_times],
        "decode_by_batch": decode_by_batch(step_times, records),
        "decode_running_mean": round(statistics.mean(step["running"] for (_, tokens), step
                                                     in zip(step_times, records, strict=True)
                                                     if not step["prefill"] and tokens), 1) if decode else None,
    }


def decode_by_batch(step_times: list[tuple[float, int]], records: list[dict]) -> dict[int, list[float]]:
    """The decode-only steps by how many requests decoded in them (one token each): batch -> [tokens/s, seconds]."""
    totals: dict[int, list[float]] = {}
    for (seconds, tokens), step in zip(step_times, records, strict=True):
        if tokens and not step["prefill"]:
            entry = totals.setdefault(tokens, [0, 0.0])
            entry[0] += tokens
            entry[1] += seconds
    return {batch: [round(tokens / seconds, 1), round(seconds, 1)] for batch, (tokens, seconds) in sorted(totals.items())}


def kernel_cost(args: argparse.Namespace, context: int, requests: int) -> dict:
    """Milliseconds per layer call of a decode step, every request at ``context`` tokens (SmolLM2's heads: 9 query,
    3 KV, 64): vLLM's CPU kernel, which computes the output with or without a recipe, and kvpolicy's part beside it
    for the policies that read statistics: a score pass at every step (what TOVA pays), or, for H2O (additive:
    `deferred`), each step's query stored and one pass over `deferred.WINDOW` of them per request, per step
    (``streaming`` and ``window`` have neither)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from ...cache.policy_group import LayerPolicies, PolicyGroup
    from ...policies.h2o import H2O
    from .compact_rows import CompactRows
    from .deferred import WINDOW
    from .paged import PagedLayerCache, PagedPolicies, cpu_cache_views

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q_heads, kv_heads, dim, bs = 9, 3, 64, args.block_size
    per_request = math.ceil((context + 1) / bs)
    blocks = 1 + requests * per_request
    table = torch.arange(1, blocks, dtype=torch.int32).view(requests, per_request)
    query = torch.randn(requests, q_heads, dim, dtype=dtype)
    output = torch.empty_like(query)
    seq_lens = torch.full((requests,), context + 1, dtype=torch.int32)
    starts = torch.arange(requests + 1, dtype=torch.int32)
    isa = _get_attn_isa(dtype, bs, dim)
    kv_cache = torch.zeros(blocks, kv_heads, bs, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * bs, dim).chunk(2, dim=2)
    slots = (table.long()[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, : context + 1].flatten()
    ops.cpu_attn_reshape_and_cache(torch.randn(len(slots), kv_heads, dim, dtype=dtype),
                                   torch.randn(len(slots), kv_heads, dim, dtype=dtype), key_cache, value_cache,
                                   slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=q_heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")

    def native_call():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=starts,
            seq_lens=seq_lens, scale=0.125, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0, scheduler_metadata=metadata, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto")

    policies = LayerPolicies([PolicyGroup(H2O(), torch.ones(1, kv_heads, dtype=torch.bool), "0.")])
    cache = PagedLayerCache.over(*cpu_cache_views(kv_cache), policies)
    rows = CompactRows.of([(table[r].tolist(), context + 1) for r in range(requests)], bs)
    index, positions = torch.arange(requests)[:, None], torch.full((requests, 1), context, dtype=torch.long)
    paged = PagedPolicies(policies)
    # the stored queries of every request's last WINDOW tokens, read in one pass: its cost over WINDOW steps
    stored = torch.randn(requests * WINDOW, q_heads, dim, dtype=dtype)
    entries = torch.arange(requests * WINDOW).view(requests, WINDOW)
    recent = torch.arange(context + 1 - WINDOW, context + 1).expand(requests, -1)
    timings = {"vLLM kernel": native_call,
               "score pass": lambda: paged.observe(cache, rows, query, index, positions, 0.125),
               "store": lambda: cache.store_queries(query, entries[:, 0], requests * WINDOW),
               "stored pass": lambda: paged.observe(cache, rows, stored, entries, recent, 0.125)}
    ms = {label: statistics.median(_timed(call, args.kernel_repeats)) * 1e3 for label, call in timings.items()}
    return {"context": context, "requests": requests, "vLLM kernel": ms["vLLM kernel"],
            "kvpolicy score pass every step": ms["score pass"],
            f"kvpolicy H2O per step (query stored, one pass per {WINDOW})": ms["store"] + ms["stored pass"] / WINDOW}


def _timed(call, repeats: int) -> list[float]:
    call()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return times


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        left.plot(row["running_per_step"], label=row["config"])
        right.plot(row["blocks_per_step"], label=row["config"])
    left.set(xlabel="engine step", ylabel="requests running", title="Requests running at once")
    right.axhline(rows[0]["kv_blocks"], color="grey", linestyle="--", label="KV blocks available")
    right.set(xlabel="engine step", ylabel="KV blocks held", title="KV blocks held")
    left.legend()
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = prompt_ids(tokenizer, args)
    blocks = args.kv_blocks or math.ceil(2.5 * (args.prompt_tokens + args.new_tokens) / args.block_size)
    args.out.mkdir(parents=True, exist_ok=True)
    bind_cores(args.tensor_parallel_size)
    rows = [run_config(recipe, prompts, args, blocks, preemption) for recipe in args.recipes
            for preemption in (["recompute"] if recipe == "full" else dict.fromkeys(args.preemption))]
    full = next((row for row in rows if row["config"] == "full"), None)
    header = ("config", "peak running", "peak blocks", "mean blocks", "preemptions", "decode tok/s",
              "end-to-end tok/s", "TTFT median s", "TTFT max s")
    print(f"\n{args.requests} requests of {min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens, "
          f"{args.new_tokens} new tokens each, {blocks} KV blocks of {args.block_size} tokens, {args.dtype}"
          + (f", prefill chunks of {args.prefill_chunk}" if args.prefill_chunk else "")
          + (", recipes evicting during prefill" if args.evict_during_prefill else "")
          + (f", {args.tensor_parallel_size} tensor-parallel ranks" if args.tensor_parallel_size > 1 else "")
          + (f", a shared prefix of {args.shared_prefix_tokens} tokens" if args.shared_prefix_tokens else "")
          + (", prefix caching on" if args.prefix_caching else ""))
    if args.prefix_caching:
        header += ("cached free blocks (mean)", "prompt tokens reused")
    print(" | ".join(header))
    for row in rows:
        ratio = ""
        if full is not None and row is not full and full["decode_tokens_per_s"] and row["decode_tokens_per_s"]:
            ratio = (f" ({row['peak_running'] / full['peak_running']:.1f}x running, "
                     f"{row['decode_tokens_per_s'] / full['decode_tokens_per_s']:.2f}x decode)")
        print(" | ".join(str(row[key]) for key in ("config", "peak_running", "peak_blocks", "mean_blocks",
                                                   "preemptions", "decode_tokens_per_s", "end_to_end_tokens_per_s",
                                                   "ttft_median_s", "ttft_max_s"))
              + (f" | {row['mean_cached_blocks']} | {row['prompt_tokens_reused']} / {row['prompt_tokens']}"
                 if args.prefix_caching else "") + ratio)
    print("\ndecode tok/s by requests in the step (tok/s, seconds spent there):")
    for row in rows:
        print(f"  {row['config']}: " + ", ".join(f"{batch}: {rate} ({seconds} s)"
                                                for batch, (rate, seconds) in row["decode_by_batch"].items()))
    from vllm.platforms import current_platform

    contexts = sorted({math.ceil(0.2 * args.prompt_tokens), args.prompt_tokens})
    kernels = []
    if current_platform.is_cpu():  # the per-layer comparison calls vLLM's CPU kernel directly
        kernels = [kernel_cost(args, context, requests) for context in contexts for requests in (1, args.requests)]
    print("\nattention per layer and decode step, ms (median):")
    for kernel in kernels:
        print(f"  context {kernel['context']}, {kernel['requests']} requests: " + ", ".join(
            f"{label} {value:.3f}" for label, value in kernel.items() if label not in ("context", "requests")))
    with (args.out / "vllm_capacity.jsonl").open("w") as file:
        for row in rows:
            file.write(json.dumps({"kind": "serving", **row}) + "\n")
        for kernel in kernels:
            file.write(json.dumps({"kind": "kernel", **kernel}) + "\n")
    plotted = plot(rows, args.out / "vllm_capacity.png")
    print(f"\nwrote {args.out / 'vllm_capacity.jsonl'}" + (f" and {args.out / 'vllm_capacity.png'}" if plotted else
                                                          " (no plot: pip install matplotlib in this environment)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
