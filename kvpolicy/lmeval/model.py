"""``KVPolicyLM``: EleutherAI's lm-evaluation-harness model type ``kvpolicy``, a Hugging Face model with a recipe.

It is lm-eval's own ``hf`` model (`HFLM`: tokenization, chat templates, batching of
generation, truncation) with every forward pass going through a kvpolicy cache:

- log-likelihood: the context is prefilled in one forward pass through a fresh policy
  cache, so the recipe evicts as it would after a prompt in serving; then the continuation
  is scored in one more pass over what the cache kept. Requests that share a context share
  its prefill (one batch row per continuation).
- rolling log-likelihood (perplexity): each window is fed in chunks of ``rolling_chunk``
  tokens, evicting between chunks; a ratio budget is a share of the window.
- generation: ``model.generate`` with a fresh policy cache per batch (left-padded rows
  each keep their own budget).

With the ``full`` recipe the numbers are the ``hf`` model's (the tests check it).
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval import utils
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..errors import KVPolicyError
from ..hf.models import load_model
from ..hf.session import attach, cache_keyword
from ..recipe import Recipe, load_recipe, with_budget
from ..recipe.budget import parse_budget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checked_arguments(recipe: Any = "full", budget: Any = None, dtype: Any = "float32") -> Recipe:
    """The recipe that ``recipe`` and ``budget`` name, or a `KVPolicyError` saying what is wrong with them (or
    with ``dtype``)."""
    if dtype not in (None, "auto", *DTYPES):
        raise KVPolicyError(f"dtype={dtype!r}: give one of {', '.join(DTYPES)}")
    loaded = load_recipe(str(recipe))
    return with_budget(loaded, parse_budget(budget)) if budget is not None else loaded


@register_model("kvpolicy")
class KVPolicyLM(HFLM):
    """``--model kvpolicy --model_args pretrained=smollm2,recipe=h2o,budget=0.2``.

    ``pretrained``: a kvpolicy model alias or a local Hugging Face folder (nothing is
    downloaded); ``recipe``: a built-in recipe name or a YAML file; ``budget``: overrides the
    recipe's; ``rolling_chunk``: tokens per forward pass in rolling log-likelihood. Other
    arguments are the ``hf`` model's (``batch_size``, ``max_length``, ``add_bos_token``, ...).
    """

    def __init__(self, pretrained: str = "smollm2", recipe: str = "full", budget: Any = None,
                 dtype: str | None = "float32", device: str | None = "cpu", rolling_chunk: int = 64,
                 **kwargs: Any) -> None:
        loaded = checked_arguments(recipe, budget, dtype)
        device = str(device or "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's command line asks for cuda by default; its hf model falls back the same way
        model, tokenizer = load_model(str(pretrained), dtype=DTYPES.get(str(dtype), torch.float32), device=device)
        super().__init__(pretrained=model, tokenizer=tokenizer, **kwargs)
        self.recipe = loaded
        self.pretrained_name = str(pretrained)
        self.rolling_chunk = int(rolling_chunk)
        self.session = attach(model, loaded, tokenizer=tokenizer)

    # --- forward passes through the policy cache ------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, cache: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {cache_keyword(self.model): cache}
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch.inference_mode():
            return self.model(input_ids=ids.to(self.device), use_cache=True, **kwargs).logits.float()

    def score_continuations(self, context: list[int], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each continuation after ``context``: the context prefilled once (one
        batch row per continuation), evicted, then the continuations in one more pass, right-padded."""
        rows = len(continuations)
        cache = self.session.new_cache()
        first = torch.log_softmax(self._forward(torch.tensor([context]).expand(rows, -1), cache)[:, -1], dim=-1)
        longest = max(len(c) for c in continuations)
        rest = None
        if longest > 1:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            ids = torch.full((rows, longest - 1), pad, dtype=torch.long)
            mask = torch.zeros(rows, len(context) + longest - 1, dtype=torch.long)
            mask[:, : len(context)] = 1
            for row, tokens in enumerate(continuations):
                ids[row, : len(tokens) - 1] = torch.tensor(tokens[:-1], dtype=torch.long)
                mask[row, len(context) : len(context) + len(tokens) - 1] = 1
            rest = torch.log_softmax(self._forward(ids, cache, mask.to(self.device)), dim=-1)
        out = []
        for row, tokens in enumerate(continuations):
            logprobs = first[row : row + 1]
            if len(tokens) > 1:
                logprobs = torch.cat([logprobs, rest[row, : len(tokens) - 1]])
            target = torch.tensor(tokens, device=logprobs.device)
            picked = logprobs.gather(-1, target[:, None])[:, 0]
            out.append((float(picked.sum()), bool((logprobs.argmax(dim=-1) == target).all())))
        return out

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, override_bs: int | None = None) -> list[tuple[float, bool]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        trimmed: list[tuple[list[int], list[int]]] = []
        for index, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self.max_length + 1):]  # left-truncate as the hf model does
            if len(continuation) >= len(whole):
                raise KVPolicyError(f"a continuation of {len(continuation)} tokens leaves no room for its context "
                                    f"within max_length={self.max_length}")
            trimmed.append((whole[: -len(continuation)], continuation))
            groups.setdefault(tuple(trimmed[-1][0]), []).append(index)
        batch = int(override_bs or (self.batch_size if str(self.batch_size).isdigit() else 1) or 1)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="kvpolicy loglikelihood")
        for context, members in groups.items():
            for start in range(0, len(members), batch):
                chunk = members[start : start + batch]
                scores = self.score_continuations(list(context), [trimmed[i][1] for i in chunk])
                for index, score in zip(chunk, scores, strict=True):
                    results[index] = score
                    if requests[index][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[index][0], score)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def stream_logprob(self, context: list[int], continuation: list[int]) -> float:
        """Log-likelihood of ``continuation`` after ``context``: the context prefilled, then the continuation fed
        ``rolling_chunk`` tokens at a time through the same policy cache, evicting between chunks (a ratio
        budget is a share of the whole window)."""
        tokens = context + continuation
        cache = self.session.new_cache(prompt_tokens=len(tokens))
        bounds = sorted({*range(len(context), len(tokens), max(1, self.rolling_chunk)), len(tokens)})
        total, fed, carry = 0.0, 0, None  # carry: the log-probabilities of the token at `fed`
        for end in bounds:
            logprobs = torch.log_softmax(self._forward(torch.tensor([tokens[fed:end]]), cache)[0], dim=-1)
            if carry is not None and fed >= len(context):
                total += float(carry[tokens[fed]])
            targets = torch.tensor(tokens[fed + 1 : end], dtype=torch.long, device=logprobs.device)
            picked = logprobs[:-1].gather(-1, targets[:, None])[:, 0]
            scored = torch.arange(fed + 1, end, device=logprobs.device) >= len(context)
            total += float(picked[scored].sum())
            carry, fed = logprobs[-1], end
        return total

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="kvpolicy rolling"):
            (string,) = request.args
            windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))
            total = sum(self.stream_logprob(list(context), list(continuation)) for context, continuation in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        generation_kwargs[cache_keyword(self.model)] = self.session.new_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        return {**info, "kvpolicy_recipe": self.recipe.name, "kvpolicy_budget": self.recipe.budget.describe(),
                "kvpolicy_model": self.pretrained_name}
