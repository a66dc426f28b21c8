"""Prefill time and decode ms/token: plain transformers vs kvpolicy `full` vs kvpolicy `h2o` (20%), eager and compiled.

    python benchmarks/core_speed.py --contexts 512 2048 4096 --new-tokens 32 --repeats 3
    python benchmarks/core_speed.py --compile --contexts 512 2048 4096   # + both compiled decode steps
    python benchmarks/core_speed.py --contexts 4096 --recipes h2o-mixed kivi --only h2o-mixed kivi

Plain transformers is SDPA + DynamicCache. ``--compile`` adds plain transformers' compiled decode
step (a StaticCache and ``torch.compile(fullgraph=True)`` of the model's forward, as
``generate(..., cache_implementation="static")`` compiles it) and kvpolicy's (``session.compile()``,
the `h2o` configuration); their first round compiles and, like every first round, is dropped.
Configurations are interleaved (A B C A B C ...) and medians reported, with a fixed thread count, so
a busy machine does not decide the result. A round's decode time is the mean of its steps, so that work
done every few steps (a recipe's ``slack``: one eviction per slack + 1 tokens) counts at its share;
give ``--new-tokens`` of at least twice such a recipe's slack. Ratios are to plain transformers eager. Text:
`pydoc_data.topics` (or --text-file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

import kvpolicy
from kvpolicy.commands.common import parse_device, parse_dtype, torch_dtype
from kvpolicy.hf.session import attach
from kvpolicy.recipe import load_recipe, with_budget
from kvpolicy.recipe.budget import parse_budget


def corpus(text_file: str | None) -> str:
    if text_file:
        return Path(text_file).read_text(encoding="utf-8")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def run_once(model, ids: torch.Tensor, cache, new_tokens: int,
             step: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> tuple[float, list[float]]:
    """Prefill seconds, then per-step decode seconds (greedy, one token per forward; ``step(token, position)`` gives
    a compiled step's logits, else the model runs eagerly)."""
    synchronize(ids.device)
    started = time.perf_counter()
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    synchronize(ids.device)
    prefill = time.perf_counter() - started
    steps = []
    for index in range(new_tokens):
        token = logits.argmax(dim=-1, keepdim=True)
        started = time.perf_counter()
        if step is None:
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
        else:
            logits = step(token, ids.shape[1] + index)
        synchronize(ids.device)
        steps.append(time.perf_counter() - started)
    return prefill, steps


def plain_compiled_step(model) -> Callable:
    """Plain transformers' compiled decode step over a StaticCache (what generate's static cache compiles)."""

    def forward(token: torch.Tensor, positions: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        return model(input_ids=token, position_ids=positions, cache=cache, use_cache=True).logits[:, -1]

    compiled = torch.compile(forward, fullgraph=True, dynamic=False)

    def step(cache: StaticCache) -> Callable[[torch.Tensor, int], torch.Tensor]:
        return lambda token, position: compiled(token, torch.full_like(token, position), cache).clone()

    return step


def kvpolicy_compiled_step(decoder, cache) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """kvpolicy's compiled decode step on ``cache`` (positions come from the cache itself)."""
    return lambda token, position: decoder.step(cache, token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", default="0.2", help="budget of the h2o configuration")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="rows per forward, each the same prompt (default: 1)")
    parser.add_argument("--compile", action="store_true", help="add the compiled decode steps (plain and h2o)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead on CUDA")
    parser.add_argument("--device", type=parse_device, default="cpu")
    parser.add_argument("--dtype", type=parse_dtype, default="float32")
    parser.add_argument("--recipes", nargs="+", default=[], metavar="RECIPE",
                        help="more kvpolicy configurations, run eagerly as their recipes say (names or YAML paths), "
                             "e.g. h2o-mixed kivi")
    parser.add_argument("--only", nargs="+", metavar="CONFIG",
                        help="run these configurations alone (plain is always run: the ratios are to it)")
    parser.add_argument("--text-file")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    warnings.filterwarnings("ignore", category=FutureWarning)
    recipes = {"full": load_recipe("full"), "h2o": with_budget(load_recipe("h2o"), parse_budget(args.budget))}
    configs = ["plain", "plain-compiled", "full", "h2o", "h2o-compiled"] if args.compile else ["plain", "full", "h2o"]
    for spec in args.recipes:
        recipe = load_recipe(spec)
        if recipe.name in configs or recipe.name.startswith("plain"):
            raise SystemExit(f"--recipes {spec}: the name {recipe.name!r} is taken; give the recipe another name")
        recipes[recipe.name] = recipe
        configs.append(recipe.name)
    if args.only:
        unknown = sorted(set(args.only) - set(configs))
        if unknown:
            raise SystemExit(f"--only {' '.join(unknown)}: no such configuration; these run: {', '.join(configs)}")
        configs = [name for name in configs if name == "plain" or name in args.only]

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tokenizer = kvpolicy.load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    all_ids = tokenizer(corpus(args.text_file), return_tensors="pt")["input_ids"].to(device)
    sessions = {name: attach(model, recipe) for name, recipe in recipes.items() if name in configs}
    options = {"backend": args.compile_backend, **({"mode": args.compile_mode} if args.compile_mode else {})}
    if "h2o-compiled" in configs:
        sessions["h2o-compiled"] = attach(model, recipes["h2o"]).compile(**options)
    if "plain-compiled" in configs:
        plain_step = plain_compiled_step(model)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} model={args.model} budget={args.budget} "
          f"device={args.device} dtype={args.dtype} batch={args.batch}" + (f" compile={options}" if args.compile else ""))

    results = []
    for context in args.contexts:
        ids = all_ids[:, :context].expand(args.batch, -1)
        samples: dict[str, tuple[list[float], list[float]]] = {}
        for repeat in range(args.repeats + 1):  # the first round warms up (and compiles) and is dropped
            for name in configs:
                step = None
                if name.startswith("plain"):
                    model.set_attn_implementation("sdpa")
                    if name == "plain":
                        cache = DynamicCache(config=model.config)
                    else:
                        cache = StaticCache(config=model.config, max_cache_len=context + args.new_tokens)
                        step = plain_step(cache)
                else:
                    model.set_attn_implementation("kvpolicy")
                    cache = sessions[name].new_cache()
                    if name.endswith("compiled"):
                        step = kvpolicy_compiled_step(sessions[name].compiled, cache)
                prefill, steps = run_once(model, ids, cache, args.new_tokens, step)
                if repeat:
                    prefills, decodes = samples.setdefault(name, ([], []))
                    prefills.append(prefill)
                    decodes.append(statistics.fmean(steps))
        plain_prefill = statistics.median(samples["plain"][0])
        plain_decode = statistics.median(samples["plain"][1])
        for name in configs:
            prefills, decodes = samples[name]
            row = {
                "context": context,
                "batch": args.batch,
                "config": name,
                "prefill_s": statistics.median(prefills),
                "decode_ms": 1000 * statistics.median(decodes),
                "prefill_ratio": statistics.median(prefills) / plain_prefill,
                "decode_ratio": statistics.median(decodes) / plain_decode,
            }
            results.append(row)
            print(
                f"context {context:>5}  {name:<14}  prefill {row['prefill_s']:6.2f} s ({row['prefill_ratio']:.2f}x)  "
                f"decode {row['decode_ms']:6.1f} ms/token ({row['decode_ratio']:.2f}x)",
                flush=True,
            )
    model.set_attn_implementation("sdpa")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
