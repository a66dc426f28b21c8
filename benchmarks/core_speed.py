"""Prefill time and decode ms/token: plain transformers vs kvpolicy `full` vs kvpolicy `h2o` (20%).

    python benchmarks/core_speed.py --contexts 512 2048 4096 --new-tokens 32 --repeats 3

Plain transformers is SDPA + DynamicCache. Configurations are interleaved
(A B C A B C ...) and medians reported, with a fixed thread count, so a busy
machine does not decide the result. Text: `pydoc_data.topics` (or --text-file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

import kvpolicy
from kvpolicy.commands.common import parse_budget
from kvpolicy.hf.session import attach
from kvpolicy.recipe import load_recipe, with_budget


def corpus(text_file: str | None) -> str:
    if text_file:
        return Path(text_file).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@torch.inference_mode()
def run_once(model, ids: torch.Tensor, cache, new_tokens: int) -> tuple[float, list[float]]:
    """Prefill seconds, then per-step decode seconds (greedy, one token per forward)."""
    started = time.perf_counter()
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    prefill = time.perf_counter() - started
    steps = []
    for _ in range(new_tokens):
        token = logits.argmax(dim=-1, keepdim=True)
        started = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
        steps.append(time.perf_counter() - started)
    return prefill, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", default="0.2", help="budget of the h2o configuration")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text-file")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    model, tokenizer = kvpolicy.load_model(args.model)
    all_ids = tokenizer(corpus(args.text_file), return_tensors="pt")["input_ids"]
    recipes = {"full": load_recipe("full"), "h2o": with_budget(load_recipe("h2o"), parse_budget(args.budget))}
    sessions = {}
    for name, recipe in recipes.items():
        sessions[name] = attach(model, recipe)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} model={args.model} budget={args.budget}")

    results = []
    for context in args.contexts:
        ids = all_ids[:, :context]
        samples: dict[str, tuple[list[float], list[float]]] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
            for name in ("plain", "full", "h2o"):
                if name == "plain":
                    model.set_attn_implementation("sdpa")
                    cache = DynamicCache(config=model.config)
                else:
                    model.set_attn_implementation("kvpolicy")
                    cache = sessions[name].new_cache()
                prefill, steps = run_once(model, ids, cache, args.new_tokens)
                if repeat:
                    prefills, decodes = samples.setdefault(name, ([], []))
                    prefills.append(prefill)
                    decodes.append(statistics.median(steps))
        plain_prefill = statistics.median(samples["plain"][0])
        plain_decode = statistics.median(samples["plain"][1])
        for name, (prefills, decodes) in samples.items():
            row = {
                "context": context,
                "config": name,
                "prefill_s": statistics.median(prefills),
                "decode_ms": 1000 * statistics.median(decodes),
                "prefill_ratio": statistics.median(prefills) / plain_prefill,
                "decode_ratio": statistics.median(decodes) / plain_decode,
            }
            results.append(row)
            print(
                f"context {context:>5}  {name:<5}  prefill {row['prefill_s']:6.2f} s ({row['prefill_ratio']:.2f}x)  "
                f"decode {row['decode_ms']:6.1f} ms/token ({row['decode_ratio']:.2f}x)",
                flush=True,
            )
    model.set_attn_implementation("sdpa")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
