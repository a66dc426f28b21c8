"""How good can *any* token-eviction policy be at a budget?  An oracle bound on streaming perplexity.

The oracle is kvpolicy's chunked streaming perplexity (64 tokens per forward) with two
powers no real policy has:

* it sees the future: before scoring a chunk, it runs the chunk once with every earlier
  token cached and keeps, per (layer, KV head), the ``budget`` earlier tokens that the
  chunk's own queries attend to most (attention mass summed over the chunk's queries and
  the query heads of the KV head);
* it never forgets: a token dropped for one chunk may come back for the next.

The chunk is then scored with only those tokens cached (plus the chunk itself, causally),
exactly like a policy's row in ``kvpolicy compare --ppl-mode chunked``, and the chunk's
K/V come from that pruned pass, as they would under eviction. Any causal policy keeping
``budget`` tokens per (layer, KV head) sees less than this oracle, so a perplexity goal
the oracle misses is out of reach of eviction at that budget (to the extent that
attention mass is what decides which tokens matter).

    python benchmarks/oracle_bound.py --tokens 4000 --budgets 0.1 0.2 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

import kvpolicy
from kvpolicy.commands.common import read_text  # the same text as compare
from kvpolicy.hf.session import cache_keyword

CHUNK = 64
_captured: dict[int, torch.Tensor] = {}
_capture = False


def oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal within the chunk, every cached token visible; records probabilities when asked."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * (scaling or dim**-0.5)
    cached = k_len - q_len
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(q_len, cached, dtype=torch.bool), causal], dim=1)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    if _capture:
        # mass each key (cached and the chunk's own) gets from the chunk's queries, per KV head
        mass = probs.sum(dim=2).view(batch, kv_heads, group, k_len).sum(dim=2)
        _captured[module.layer_idx] = mass
    out = (probs @ value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def oracle_ppl(model, ids: torch.Tensor, budget: int, select: str = "future", recent: float = 0.0) -> float:
    """Chunked streaming perplexity of ``ids`` with the oracle's cache of ``budget`` tokens per (layer, KV head).

    ``select``: whose attention picks the tokens, "future" (the scored chunk's own queries:
    the bound), "previous" (the chunk before's) or "history" (every earlier query's, summed as
    H2O does); the last two are causal choices, but still un-evicting.
    ``recent``: the share of the budget pinned to the most recent tokens (as H2O's window).
    """
    AttentionInterface.register("kvpolicy_oracle", oracle_attention)
    previous_impl = model.config._attn_implementation
    model.set_attn_implementation("kvpolicy_oracle")
    try:
        return _run(model, ids, budget, select, round(recent * budget))
    finally:
        model.set_attn_implementation(previous_impl)


def _run(model, ids: torch.Tensor, budget: int, select: str, recent: int) -> float:
    global _capture
    _captured.clear()
    layers = model.config.num_hidden_layers
    keys: list[torch.Tensor | None] = [None] * layers  # every token's K/V, as computed in its pruned pass
    values: list[torch.Tensor | None] = [None] * layers
    total, count = 0.0, ids.numel() - 1
    keyword = cache_keyword(model)
    history: list[torch.Tensor | None] = [None] * layers
    with torch.inference_mode():
        for start in range(0, count, CHUNK):
            chunk = ids[start : min(start + CHUNK, count)]
            targets = ids[start + 1 : start + 1 + chunk.numel()]
            positions = torch.arange(start, start + chunk.numel())[None]
            keep = None
            previous = dict(_captured)
            if select == "history":
                for i, mass in previous.items():  # every earlier query's attention, summed (H2O's score)
                    history[i] = (
                        mass
                        if history[i] is None
                        else mass + F.pad(history[i], (0, mass.shape[-1] - history[i].shape[-1]))
                    )
            # the full-context pass only feeds a selection: this chunk's (future), or every chunk's for the causal ones
            if budget < count and (select != "future" or start > budget):
                _capture = True
                model(
                    input_ids=chunk[None],
                    position_ids=positions,
                    use_cache=True,
                    **{keyword: _cache(keys, values, None)},
                )
                _capture = False
            if start > budget:
                # future: this chunk's queries; previous: the last chunk's; history: all earlier queries'
                chosen_by = {
                    "future": [_captured[i][..., :start] for i in range(layers)],
                    "previous": previous,
                    "history": history,
                }
                mass = [chosen_by[select][i] for i in range(layers)]
                if recent:
                    mass = [m.index_fill(-1, torch.arange(start - recent, start), math.inf) for m in mass]
                keep = [m.topk(budget, dim=-1).indices.sort(dim=-1).values for m in mass]
            cache = _cache(keys, values, keep)
            logits = (
                model(input_ids=chunk[None], position_ids=positions, use_cache=True, **{keyword: cache})
                .logits[0]
                .float()
            )
            total -= logits.log_softmax(-1).gather(-1, targets[:, None]).sum().item()
            for i in range(layers):  # append the chunk's K/V from the pruned pass
                k, v = (
                    cache.layers[i].keys[:, :, -chunk.numel() :],
                    cache.layers[i].values[:, :, -chunk.numel() :],
                )
                keys[i] = k if keys[i] is None else torch.cat([keys[i], k], dim=2)
                values[i] = v if values[i] is None else torch.cat([values[i], v], dim=2)
    return math.exp(total / count)


def _cache(keys, values, keep) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k is None:
            continue
        if keep is not None:
            index = keep[i][..., None].expand(-1, -1, -1, k.shape[-1])
            k, v = k.gather(2, index), v.gather(2, index)
        cache.update(k, v, i)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--select",
        choices=["future", "previous", "history"],
        default="future",
        help="future: the scored chunk's own attention (the bound); previous: the chunk before's; "
        "history: every earlier query's, summed",
    )
    parser.add_argument(
        "--recent", type=float, default=0.0, help="share of the budget pinned to recent tokens"
    )
    parser.add_argument("--text-file", default=None, help="default: pydoc_data.topics, as compare")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvpolicy.load_model(args.model)
    text, _ = read_text(args.text_file)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)[
        : args.tokens
    ]
    for ratio in [1.0, *args.budgets]:
        budget = ids.numel() if ratio >= 1.0 else max(1, round(ratio * ids.numel()))
        started = time.perf_counter()
        ppl = oracle_ppl(model, ids, budget, args.select, args.recent)
        row = {
            "select": args.select,
            "recent": args.recent,
            "oracle_budget_ratio": ratio,
            "budget_tokens": budget,
            "tokens": ids.numel(),
            "ppl": ppl,
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
