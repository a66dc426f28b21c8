"""Which of a RULER needle's tokens each recipe keeps after the prompt, and whether it then answers.

    python benchmarks/needle_kept.py --task niah_single_1 --prompt-tokens 1000 --recipes h2o tova snapkv-wide

For each sample of the task (seed 0, 5 samples at depths 10% ... 90%), the prompt is prefilled
through each recipe's cache in one call, as `kvpolicy compare` does (eviction after it), and the
cache's kept positions are read: the share of the queried needle sentence's tokens still cached
(mean over layers and KV heads), the share of the kept tokens that come from the first 20% of
the prompt (a bias toward early tokens shows here), then the greedy answer and RULER's score.
A recipe whose score collapses while it keeps few needle tokens lost the needle to eviction;
one that keeps the tokens and still fails lost it elsewhere (its positions, its other tokens).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import kvpolicy
from kvpolicy.commands.common import read_text
from kvpolicy.hf.session import attach
from kvpolicy.recipe import load_recipe, with_budget
from kvpolicy.recipe.budget import parse_budget
from kvpolicy.tasks.ruler import GENERATORS
from kvpolicy.tasks.ruler.haystack import TextHaystack
from kvpolicy.tasks.ruler.prompt import Sample
from kvpolicy.tasks.ruler.scoring import match_share


@torch.inference_mode()
def measure(model, tokenizer, session, sample: Sample) -> tuple[float, float, float]:
    """(needle tokens kept, kept tokens from the prompt's first 20%, RULER score) of one sample."""
    needle = sample.needles[0]
    start = needle.token_index
    end = start + len(tokenizer(needle.text, add_special_tokens=False)["input_ids"])
    cache = session.new_cache()
    logits = model(input_ids=torch.tensor([sample.input_ids]), cache=cache, use_cache=True).logits[:, -1]
    needle_kept, early = [], []
    for layer in range(model.config.num_hidden_layers):
        for head in cache.kept_positions(layer)[0]:
            kept = torch.tensor(head)
            needle_kept.append(float(((kept >= start) & (kept < end)).sum()) / (end - start))
            early.append(float((kept < 0.2 * len(sample.input_ids)).float().mean()))
    answer = []
    for _ in range(sample.max_new_tokens):
        token = logits.argmax(dim=-1, keepdim=True)
        if int(token) == tokenizer.eos_token_id:
            break
        answer.append(int(token))
        logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    score = match_share(tokenizer.decode(answer), sample.answers)
    return statistics.fmean(needle_kept), statistics.fmean(early), score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="niah_single_1", choices=[name for name in GENERATORS if "niah" in name])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--recipes", nargs="+", default=["h2o", "tova", "snapkv-wide"])
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text-file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = kvpolicy.load_model(args.model)
    haystack = TextHaystack(read_text(args.text_file)[0])
    generator = GENERATORS[args.task][0]
    samples = [generator.sample(args.task, tokenizer, haystack, args.prompt_tokens, index, args.samples, 0)
               for index in range(args.samples)]
    print(f"{args.task} at {args.prompt_tokens} tokens, budget {args.budget}, depths "
          + " ".join(f"{sample.depth:g}" for sample in samples))
    print(f"{'recipe':<14} {'score':>6} {'needle kept':>12} {'from first 20%':>15}  needle kept per depth")
    for name in args.recipes:
        recipe = load_recipe(name)
        if name != "full":
            recipe = with_budget(recipe, parse_budget(args.budget))
        session = attach(model, recipe)
        rows = [measure(model, tokenizer, session, sample) for sample in samples]
        kept, early, scores = (statistics.fmean(column) for column in zip(*rows, strict=True))
        per_depth = " ".join(f"{row[0]:.0%}" for row in rows)
        print(f"{name:<14} {scores:>6.0%} {kept:>12.0%} {early:>15.0%}  {per_depth}", flush=True)


if __name__ == "__main__":
    main()
