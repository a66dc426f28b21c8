"""End-to-end checks and timings of kvpolicy on one CUDA GPU, on a SmolLM2-shaped model.

    python benchmarks/gpu_check.py --config-dir DIR --out results.json

The model has SmolLM2-135M's architecture (30 layers, 9 query heads over 3 KV heads, head
dim 64) read from ``DIR/config.json``, with random weights (seeded): the GPU machine has
no copy of the real weights, and speed and memory do not depend on them. The random
model is saved next to the config (``DIR/model.safetensors``) so that the CLI can load
the same folder with ``--model DIR``.

1. Parity, fp32: a left-padded batch of 3 prompts, 16 greedy steps.
   * kvpolicy ``full`` on the Triton backend against plain transformers (SDPA + DynamicCache):
     the same tokens, logits within 1e-3.
   * ``h2o`` with a 64-token budget on the Triton backend against the torch backend on the
     same GPU: the share of (layer, row, head) kept sets that agree after the last step,
     and whether the tokens agree (near-ties in accumulated attention may flip a choice).
2. Speed and memory, bf16: prefill seconds and decode ms/token (medians of interleaved
   rounds after a warm-up) and peak GPU memory for plain transformers, ``full`` (Triton),
   ``h2o`` 20% (Triton and torch backends) and ``streaming`` 20%, per context and batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from kvpolicy.hf.session import attach, cache_keyword  # noqa: E402
from kvpolicy.recipe import load_recipe, with_budget  # noqa: E402
from kvpolicy.recipe.budget import Budget  # noqa: E402

DEVICE = torch.device("cuda")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def random_model(config_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    if not (config_dir / "model.safetensors").exists():
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(config_dir)
        config.max_position_embeddings = max(config.max_position_embeddings, 65536)
        AutoModelForCausalLM.from_config(config).save_pretrained(config_dir)
    model = AutoModelForCausalLM.from_pretrained(config_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(DEVICE).eval()


def padded_prompts(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=gen)
        mask[row, width - length :] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def greedy(model, ids, mask, steps, cache=None):
    kwargs = {cache_keyword(model): cache} if cache is not None else {}
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
        pad_token_id=2, output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences, torch.stack(out.logits, dim=1).float()


@torch.inference_mode()
def parity(config_dir: Path) -> dict:
    model = random_model(config_dir, torch.float32)
    ids, mask = padded_prompts([300, 211, 120], model.config.vocab_size)
    plain_tokens, plain_logits = greedy(model, ids, mask, 16)
    session = attach(model, "full", backend="triton")
    full_tokens, full_logits = greedy(model, ids, mask, 16, session.new_cache())
    session.detach()
    result = {
        "full_triton_same_tokens": bool(torch.equal(full_tokens, plain_tokens)),
        "full_triton_max_logit_diff": float((full_logits - plain_logits).abs().max()),
    }
    kept, tokens = {}, {}
    for backend in ("torch", "triton"):
        session = attach(model, with_budget(load_recipe("h2o"), Budget(tokens=64)), backend=backend)
        cache = session.new_cache()
        tokens[backend], _ = greedy(model, ids, mask, 16, cache)
        kept[backend] = [cache.kept_positions(i) for i in range(model.config.num_hidden_layers)]
        counts = [len(head) for layer in kept[backend] for row in layer for head in row]
        result[f"h2o_{backend}_kept_per_head"] = [min(counts), max(counts)]
        session.detach()
    flat = {name: [head for layer in layers for row in layer for head in row] for name, layers in kept.items()}
    cells = list(zip(flat["torch"], flat["triton"], strict=True))
    result["h2o_triton_vs_torch_same_kept_sets"] = sum(sorted(a) == sorted(b) for a, b in cells) / len(cells)
    result["h2o_triton_vs_torch_same_tokens"] = bool(torch.equal(tokens["torch"], tokens["triton"]))
    print(json.dumps(result, indent=1), flush=True)
    return result


@torch.inference_mode()
def run_once(model, ids, cache, new_tokens) -> tuple[float, float, int]:
    sync()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = model(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True).logits[:, -1]
    sync()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = logits.argmax(dim=-1, keepdim=True)
        logits = model(input_ids=token, **{cache_keyword(model): cache}, use_cache=True).logits[:, -1]
    sync()
    decode = (time.perf_counter() - start) / new_tokens
    return prefill, decode, torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0


def speed(config_dir: Path, contexts: list[int], batches: list[int], new_tokens: int, repeats: int) -> list[dict]:
    model = random_model(config_dir, torch.bfloat16)
    recipes = {
        "full-triton": ("full", "triton"),
        "h2o20-triton": (with_budget(load_recipe("h2o"), Budget(ratio=0.2)), "triton"),
        "h2o20-torch": (with_budget(load_recipe("h2o"), Budget(ratio=0.2)), "torch"),
        "streaming20": (with_budget(load_recipe("streaming"), Budget(ratio=0.2)), "triton"),
    }
    sessions = {}
    for name, (recipe, backend) in recipes.items():
        sessions[name] = attach(model, recipe, backend=backend)
    rows = []
    for context in contexts:
        for batch in batches:
            ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(1))
            ids = ids.to(DEVICE)
            samples: dict[str, list[tuple[float, float, int]]] = {}
            for repeat in range(repeats + 1):  # round 0 compiles and warms up
                for name in ("plain", *recipes):
                    if name == "plain":
                        model.set_attn_implementation("sdpa")
                        cache = DynamicCache(config=model.config)
                    else:
                        model.set_attn_implementation("kvpolicy")
                        cache = sessions[name].new_cache()
                    sample = run_once(model, ids, cache, new_tokens)
                    del cache
                    if repeat:
                        samples.setdefault(name, []).append(sample)
            plain_prefill = statistics.median(s[0] for s in samples["plain"])
            plain_decode = statistics.median(s[1] for s in samples["plain"])
            for name, values in samples.items():
                prefill = statistics.median(s[0] for s in values)
                decode = statistics.median(s[1] for s in values)
                row = {
                    "context": context, "batch": batch, "config": name, "prefill_s": prefill,
                    "decode_ms": 1000 * decode, "prefill_ratio": prefill / plain_prefill,
                    "decode_ratio": decode / plain_decode, "peak_gib": max(s[2] for s in values) / 2**30,
                }
                rows.append(row)
                print(
                    f"ctx {context:>6} batch {batch:>2} {name:<13} prefill {prefill * 1000:8.1f} ms "
                    f"({row['prefill_ratio']:.2f}x)  decode {row['decode_ms']:7.2f} ms/token "
                    f"({row['decode_ratio']:.2f}x)  peak {row['peak_gib']:.2f} GiB",
                    flush=True,
                )
    model.set_attn_implementation("sdpa")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-dir", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=["parity", "speed"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1) checks the script's logic")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}", flush=True)
    results: dict = {}
    if "parity" not in args.skip:
        results["parity"] = parity(args.config_dir)
    if "speed" not in args.skip:
        results["speed"] = speed(args.config_dir, args.contexts, args.batches, args.new_tokens, args.repeats)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
