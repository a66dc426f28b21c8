"""A compiled decode step for a kvpolicy session: the whole model step captured by ``torch.compile(fullgraph=True)``.

`CompiledDecoder` runs the prompt eagerly, then every decode step through one compiled
function of the model, once each layer of the cache can take the static decode step
(`kvpolicy.cache.static_step`: every cell at one common budget, packed, no slack); until then
(a prompt shorter than the budget) steps run eagerly. Each compiled step passes explicit
positions (each row's real tokens seen, kept on the device) and a placeholder 4-D mask, so
transformers asks the cache nothing that changes from step to step, and nothing is read
back to the host: the graph is specialized once and replayed (CUDA graphs where the mode
asks for them). Counters the step leaves alone are advanced after it, in Python; NaN
checks of the policies' scores are read every `NAN_CHECK_EVERY` steps.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import KVPolicyError
from .cache import PolicyCache, cache_keyword

#: steps between reads of the policies' NaN flags (each read waits for the device)
NAN_CHECK_EVERY = 32
#: steps between checks that every row has finished (one host sync each)
STOP_CHECK_EVERY = 8


def static_blockers(cache: PolicyCache) -> list[str]:
    """Why layers of ``cache`` cannot take the static decode step now ("layer i: reason"), empty when all can."""
    return [f"layer {layer.layer_idx}: {reason}" for layer in cache.layers
            if (reason := layer.static_step.blocker()) is not None]


def _model_step(model: Any, keyword: str, cache: PolicyCache, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    output = model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, **{keyword: cache})
    return output.logits[:, -1]


class CompiledDecoder:
    """Decode steps of ``model`` through ``torch.compile(fullgraph=True, dynamic=False, **options)``."""

    def __init__(self, model: Any, **options: Any):
        self.model = model
        self.keyword = cache_keyword(model)
        self.options = {"fullgraph": True, "dynamic": False, **options}
        self.compiled = torch.compile(_model_step, **self.options)
        self.compiled_steps = 0  # steps that ran compiled, over the decoder's life (for tests and reports)
        self._primed: weakref.WeakSet[PolicyCache] = weakref.WeakSet()  # caches whose static tensors are pinned

    def step(self, cache: PolicyCache, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens`` [B, 1] in, next-token logits [B, V] out (compiled when the cache allows)."""
        layers = cache.layers
        positions = layers[0].tokens_seen[:, None].clone()
        if static_blockers(cache):
            output = self.model(input_ids=tokens, position_ids=positions, use_cache=True, **{self.keyword: cache})
            return output.logits[:, -1]
        if cache not in self._primed:
            for layer in layers:
                layer.static_step.prime(tokens.device)
                for tensor in layer.static_step.tensors():  # written in place at every step: CUDA graphs may keep them
                    torch._dynamo.mark_static_address(tensor)
            self._primed.add(cache)
        mask = torch.ones(tokens.shape[0], 1, 1, 1, dtype=torch.bool, device=tokens.device)  # never read
        for layer in layers:
            layer.static_step.active = True
        try:
            logits = self.compiled(self.model, self.keyword, cache, tokens, positions, mask)
        finally:
            for layer in layers:
                layer.static_step.active = False
        for layer in layers:
            layer.static_step.after_steps(1)
        self.compiled_steps += 1
        if self.compiled_steps % NAN_CHECK_EVERY == 0:
            check_nan(cache)
        return logits.clone()  # the graph may reuse its output buffer at the next step

    @torch.inference_mode()
    def generate(self, cache: PolicyCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None) -> torch.Tensor:
        """Greedy decoding: the prompt (left-padded rows allowed) then ``max_new_tokens`` steps; [B, prompt + new].

        Rows that produced an end token continue with ``pad_token_id``, and decoding stops once every row has
        (checked every `STOP_CHECK_EVERY` steps; the output is cut where the last row finished), as
        ``generate`` does.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                            **{self.keyword: cache})
        logits = output.logits[:, -1]
        ends = torch.tensor([] if eos_token_id is None else
                            ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)),
                            dtype=torch.long, device=input_ids.device)
        pad = pad_token_id if pad_token_id is not None else (int(ends[0]) if ends.numel() else 0)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        new: list[torch.Tensor] = []
        for index in range(max_new_tokens):
            token = torch.where(finished, pad, logits.argmax(dim=-1))
            new.append(token)
            finished = finished | torch.isin(token, ends)
            if index + 1 == max_new_tokens:
                break
            if ends.numel() and (index + 1) % STOP_CHECK_EVERY == 0 and bool(finished.all()):
                break
            logits = self.step(cache, token[:, None])
        check_nan(cache)
        tokens = torch.stack(new, dim=1)
        if ends.numel():  # cut where the last row finished, as generate stops there
            done = torch.cumsum(torch.isin(tokens, ends).long(), dim=1) > 0
            all_done = done.all(dim=0)
            if bool(all_done.any()):
                tokens = tokens[:, : int(all_done.long().argmax()) + 1]
        return torch.cat([input_ids, tokens], dim=1)


def check_nan(cache: PolicyCache) -> None:
    """Raise if a policy's scores held NaN in a compiled step (reads the device's flags)."""
    for layer in cache.layers:
        layer.static_step.raise_noted()


def generate_arguments(args: tuple, kwargs: dict[str, Any], model: Any) -> dict[str, Any]:
    """The arguments of ``session.generate`` that a compiled session supports, or a KVPolicyError naming the others."""
    kwargs = dict(kwargs)
    if args:
        kwargs.setdefault("input_ids", args[0])
    config = kwargs.pop("generation_config", None) or model.generation_config
    if kwargs.pop("do_sample", getattr(config, "do_sample", False)):
        raise KVPolicyError("a compiled session decodes greedily: pass do_sample=False (or use an uncompiled session "
                            "for sampling)")
    kwargs.pop("use_cache", None)  # True here: `Session.generate` handles use_cache=False before
    chosen = {
        "input_ids": kwargs.pop("input_ids", None),
        "attention_mask": kwargs.pop("attention_mask", None),
        "max_new_tokens": kwargs.pop("max_new_tokens", None) or getattr(config, "max_new_tokens", None) or 20,
        "eos_token_id": kwargs.pop("eos_token_id", getattr(config, "eos_token_id", None)),
        "pad_token_id": kwargs.pop("pad_token_id", getattr(config, "pad_token_id", None)),
    }
    if chosen["input_ids"] is None:
        raise KVPolicyError("a compiled session's generate needs input_ids")
    if kwargs:
        raise KVPolicyError(f"a compiled session's generate takes input_ids, attention_mask, max_new_tokens, "
                            f"eos_token_id and pad_token_id (greedy decoding); not {', '.join(sorted(kwargs))}")
    return chosen
