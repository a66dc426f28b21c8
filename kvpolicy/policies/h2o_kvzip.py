"""H2O with KVzip's prompt scores: heavy hitters among the prompt's tokens by how much the model needs them to
repeat the prompt (`kvzip.py`'s probe), plus the attention every query after the prompt gives them, as in H2O.

H2O's own heavy-hitter score for a prompt token is the attention the prompt's later tokens paid it, which says what
the prompt's end needed, not what a later question will; a needle in the middle of a document scores low. Here the
prompt's attention is replaced, once the probe is over, by KVzip's score (the most attention any repeating query
gave the token); the queries after the prompt (a question, generated tokens) add their attention to it, and the
`recent_ratio` share of the budget goes to the newest tokens, as in H2O. ``h2o-kvzip-ada`` splits each layer's
budget among its KV heads by these scores (AdaKV's split, `kvzip.headwise_budgets`), as ``kvzip-ada`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionStats, TokenView
from .h2o import H2O, H2OParams
from .kvzip import HeadSplit, HeadSplitParams, KVzip, KVzipParams


@dataclass(frozen=True)
class H2OKVzipParams(H2OParams):
    chunk: int = 2048  # prompt tokens repeated per probe pass (KVzip's)
    request: str = KVzipParams.request
    request_next: str = KVzipParams.request_next

    def validate(self) -> None:
        super().validate()
        KVzipParams(chunk=self.chunk, request=self.request, request_next=self.request_next).validate()


class H2OKVzip(H2O):
    name = "h2o-kvzip"
    description = "H2O whose prompt tokens are scored by KVzip's repetition probe, then by later queries' attention"
    Params = H2OKVzipParams
    probe_needs = frozenset({"colmax"})
    state = {"acc": torch.float32, "probe": torch.float32}

    def __init__(self, params: H2OKVzipParams | None = None) -> None:
        super().__init__(params)
        p = self.params
        self.repeat = KVzip(KVzipParams(sinks=0, chunk=p.chunk, request=p.request, request_next=p.request_next))

    def prepare(self, model: Any = None, tokenizer: Any = None) -> None:
        self.repeat.prepare(model, tokenizer)

    def probe_chunks(self, prompt_ids: list[int]) -> list[list[int]]:
        return self.repeat.probe_chunks(prompt_ids)

    def observe_probe(self, state: dict[str, torch.Tensor], stats: AttentionStats, view: TokenView) -> None:
        state["acc"].zero_()  # the prompt's own attention gives way to the probe's (from then on: later queries')
        torch.maximum(state["probe"], stats.colmax, out=state["probe"])

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        return super().score({**state, "acc": state["acc"] + state["probe"]}, view)


@dataclass(frozen=True)
class H2OKVzipAdaParams(HeadSplitParams, H2OKVzipParams):
    pass


class H2OKVzipAda(HeadSplit, H2OKVzip):
    name = "h2o-kvzip-ada"
    description = "h2o-kvzip with each layer's budget split among its KV heads by the same scores (AdaKV's split)"
    Params = H2OKVzipAdaParams  # the recent window (+inf) is each head's own
