"""KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", NeurIPS'25).

Score, set once, right after the prompt: the model is asked to repeat the prompt, and each prompt
token gets the most attention any query of that repetition gave it, in any query head of its KV
head (`colmax`). A token the model needs to rebuild the prompt is one a later question can need,
whatever the question, so the score does not depend on one (unlike SnapKV's last prompt queries).

The repetition is a probe (`Policy.probe_needs`, `kvpolicy.hf.probe`): for each `chunk` of the
prompt's tokens, a forward pass of ``request`` + the chat template's end of the user turn + the
chunk (from the second chunk on, the request names the last 8 tokens of the one before, as the
authors do); its tokens leave the cache afterwards. It costs about one more prefill of the prompt.
The first `sinks` tokens are kept whatever they score; tokens that come after the prompt (a
question, an answer) rank above every prompt token, newest first, so with a budget that binds
while decoding each one displaces the weakest prompt token. ``kvzip-ada`` splits each layer's
budget among its KV heads by these scores (`KVzipAda`, AdaKV's split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KVPolicyError
from .base import AttentionStats, Policy, TokenView

MARK = "\u2063kvzip\u2063"  # a user message whose text is found again in the chat template's output
LAST_TOKENS = 8  # tokens of the previous chunk that the request for the next one quotes


@dataclass(frozen=True)
class KVzipParams:
    sinks: int = 4  # first tokens kept whatever they score
    chunk: int = 2048  # prompt tokens repeated per probe pass
    request: str = "Repeat the previous context exactly."  # the paper's request, after a blank line
    request_next: str = "Repeat the part of the previous context exactly, starting with"

    def validate(self) -> None:
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.chunk < 16:
            raise ValueError("chunk must be >= 16 tokens")
        if not self.request.strip() or not self.request_next.strip():
            raise ValueError("request and request_next must not be empty")


class KVzip(Policy):
    name = "kvzip"
    description = "prompt tokens by the most attention they get while the model repeats the prompt (a probe)"
    Params = KVzipParams
    probe_needs = frozenset({"colmax"})
    state = {"probe": torch.float32, "probed": torch.bool}

    def prepare(self, model: Any = None, tokenizer: Any = None) -> None:
        if tokenizer is None:
            raise KVPolicyError(f"policy {self.name!r} writes its repeat request with the model's tokenizer: pass it, "
                                "kvpolicy.attach(model, recipe, tokenizer=tokenizer)")

        def ids(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        suffix = "\n"
        if getattr(tokenizer, "chat_template", None):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                                 add_generation_prompt=True)
            suffix = chat.split(MARK, 1)[1]
        self._first, self._next = ids(f"\n\n{self.params.request}"), ids(f"\n\n{self.params.request_next}")
        self._suffix = ids(suffix)

    def probe_chunks(self, prompt_ids: list[int]) -> list[list[int]]:
        size = self.params.chunk
        chunks = [prompt_ids[start : start + size] for start in range(0, len(prompt_ids), size)]
        return [(self._first if i == 0 else self._next + chunks[i - 1][-LAST_TOKENS:]) + self._suffix + chunk
                for i, chunk in enumerate(chunks)]

    def observe_probe(self, state: dict[str, torch.Tensor], stats: AttentionStats, view: TokenView) -> None:
        torch.maximum(state["probe"], stats.colmax, out=state["probe"])
        state["probed"] |= view.valid  # the pass's own tokens too: they leave right after

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        later = 2.0 + view.positions.float()  # after the prompt: above every probability, newest first
        score = torch.where(state["probed"], state["probe"], later)
        return score.masked_fill(view.valid & (view.positions < self.params.sinks), torch.inf)


@dataclass(frozen=True)
class HeadSplitParams:
    alpha: float = 0.0  # share of each head's budget it keeps whatever the other heads score (KVzip: none)

    def validate(self) -> None:
        super().validate()  # the policy's own params, after this in the MRO
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("alpha must be in [0, 1]")


class HeadSplit:
    """A policy whose ``score`` ranks a layer's tokens across its heads, split as AdaKV does (`headwise_budgets`):
    tokens scoring at least ``pinned_from`` are each head's own."""

    allocates = True
    pinned_from = torch.inf

    def allocate(self, state: dict[str, torch.Tensor], view: TokenView, cells: torch.Tensor) -> torch.Tensor:
        score = self.score(state, view)
        return headwise_budgets(score, score >= self.pinned_from, view, cells, self.params.alpha)


@dataclass(frozen=True)
class KVzipAdaParams(HeadSplitParams, KVzipParams):
    pass


class KVzipAda(HeadSplit, KVzip):
    name = "kvzip-ada"
    description = "KVzip's scores, each layer's budget split among its KV heads by them (AdaKV's split)"
    Params = KVzipAdaParams
    pinned_from = 2.0  # sinks and the tokens after the prompt


def headwise_budgets(score: torch.Tensor, pinned: torch.Tensor, view: TokenView, cells: torch.Tensor,
                     alpha: float) -> torch.Tensor:
    """AdaKV's split of each row's budget over a layer's ``cells`` [B, Hkv] by ``score`` [B, Hkv, T]: each head keeps
    its ``pinned`` tokens and its best ``floor(alpha x budget)`` (up to its budget), and the rest of the layer's total
    goes to the layer's best remaining (head, token) pairs. Returns the budgets [B, Hkv]."""
    valid, budget = view.valid, view.budget
    batch, heads, slots = valid.shape
    score = score.masked_fill(~valid, -torch.inf)
    place = score.argsort(dim=2, descending=True, stable=True).argsort(dim=2)
    floor = torch.floor(budget.double() * alpha).long()
    forced = torch.minimum(torch.maximum(floor, (pinned & valid).sum(dim=2)), budget).clamp(max=valid.sum(dim=2))
    forced = torch.where(cells, forced, 0)
    free = valid & cells[..., None] & (place >= forced[..., None])
    rest = torch.where(cells, budget, 0).sum(dim=1) - forced.sum(dim=1)  # [B]
    key = score.masked_fill(~free, -torch.inf).reshape(batch, -1)
    best = key.argsort(dim=1, descending=True, stable=True)
    take = (torch.arange(heads * slots, device=key.device) < rest[:, None]) & (key.gather(1, best) > -torch.inf)
    chosen = torch.zeros_like(take).scatter_(1, best, take).view(batch, heads, slots)
    return torch.where(cells, forced + chosen.sum(dim=2), budget)
