"""Deliberately naive references for H2O, Scissorhands, LazyEviction, RoCo, TOVA, SnapKV and AdaKV (brute force, explicit attention).

Every K/V stays in a DynamicCache, eviction is simulated with
Python sets of (padded) indices, attention is computed one query head and one key at a
time, and each policy's rule is applied by hand to Python floats after every attention
call (the prefill, then each decode step). Nothing is shared with kvpolicy.
"""

from __future__ import annotations

import math
from statistics import variance

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpolicy.hf.cache import cache_keyword


class BruteForce:
    """Explicit attention over the kept tokens; ``rule`` decides what stays after each call."""

    name = "bruteforce"

    def __init__(self, budget: int, slack: int = 0):
        self.budget, self.slack = budget, slack
        self.kept: dict[tuple[int, int, int], set[int]] = {}  # (layer, row, kv head) -> padded indices
        self.data: dict[tuple[int, int, int], dict] = {}  # per (layer, row, kv head): the rule's own bookkeeping
        self.current: dict[int, list[list[list[int]]]] = {}  # layer -> [row][head] kept real positions

    def register(self) -> None:
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, lambda *a, attention_mask=None, **k: attention_mask)

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        batch, q_heads, queries, dim = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        scaling = scaling or dim**-0.5
        real = torch.ones(batch, total, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, -total:]
        self.position = (torch.cumsum(real.long(), dim=1) - 1).tolist()
        out = torch.zeros(batch, queries, q_heads, dim)
        first_new = total - queries
        self.key, self.value = key, value  # the cache's own tensors: a rule that merges writes into them
        for b in range(batch):
            self.seen = int(real[b].sum())
            calls = {}
            for h in range(kv_heads):
                kept = self.kept.setdefault((layer, b, h), set())
                new = [j for j in range(first_new, total) if real[b, j]]
                kept.update(new)
                rows = []  # per real query: (index, visible keys, [per query head: {key: probability}])
                for i in range(first_new, total):
                    if not real[b, i]:
                        continue
                    cols = sorted(j for j in kept if j <= i)
                    heads = []
                    bias = [self.logit_bias(layer, b, h, j) for j in cols]
                    for g in range(group):
                        probs = attend_one(query, key, value, out, b, h * group + g, i - first_new, cols, scaling,
                                           bias)
                        heads.append(dict(zip(cols, probs, strict=True)))
                    rows.append((i, cols, heads))
                calls[h] = (new, rows)
            self.rule(layer, b, calls)
        self.current[layer] = [
            [sorted(self.position[b][j] for j in self.kept[(layer, b, h)]) for h in range(kv_heads)]
            for b in range(batch)
        ]
        return out.to(query.dtype), None

    def rule(self, layer: int, b: int, calls: dict[int, tuple[list[int], list]]) -> None:
        raise NotImplementedError

    def logit_bias(self, layer: int, b: int, h: int, j: int) -> float:
        """Added to every query's logit of key ``j`` (a merging rule's proportional attention); 0 by default."""
        return 0.0

    def keep_best(self, layer: int, b: int, h: int, key) -> None:
        """Keep the ``budget`` tokens with the largest ``key(j)`` once the head holds more than budget + slack."""
        kept = self.kept[(layer, b, h)]
        if len(kept) > self.budget + self.slack:
            kept.intersection_update(sorted(kept, key=key, reverse=True)[: self.budget])

    def age(self, j: int, b: int) -> int:
        """1 for the newest real token of row b."""
        return self.seen - self.position[b][j]


def attend_one(query, key, value, out, b, qh, q, cols, scaling, bias=None) -> list[float]:
    """Query ``q`` of query head ``qh`` (row ``b``) over the keys ``cols`` of its KV head, one at a time: its output
    written to ``out[b, q, qh]``, its probabilities returned in the order of ``cols`` (``bias``: added to each
    key's logit, in that order)."""
    h = qh // (query.shape[1] // key.shape[1])
    logits = [float(query[b, qh, q] @ key[b, h, j]) * scaling for j in cols]
    if bias is not None:
        logits = [x + c for x, c in zip(logits, bias, strict=True)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    probs = [w / sum(weights) for w in weights]
    out[b, q, qh] = sum(p * value[b, h, j] for p, j in zip(probs, cols, strict=True))
    return probs


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


class BruteForceH2O(BruteForce):
    """Zhang et al., Algorithm 1 with the recent window: accumulated attention, the newest `recent` pinned."""

    name = "h2o_bruteforce"

    def __init__(self, budget: int, recent_ratio: float = 0.5, decay: float = 1.0, threshold: float | None = None):
        super().__init__(budget)
        self.recent, self.decay, self.threshold = round(budget * recent_ratio), decay, threshold

    def rule(self, layer, b, calls):
        for h, (_, rows) in calls.items():
            score = self.data.setdefault((layer, b, h), {})
            for j in score:  # older attention fades by `decay` per query of this call
                score[j] *= self.decay ** len(rows)
            for _, cols, heads in rows:
                for j in cols:
                    score[j] = score.get(j, 0.0) + mean(head[j] for head in heads)
            kept = self.kept[(layer, b, h)]
            recent = set(sorted(kept, reverse=True)[: self.recent])
            if self.threshold is None:
                self.keep_best(layer, b, h, key=lambda j: (j in recent, score[j]))
                continue
            # a threshold budget: the recent ones and those scoring at least threshold x the other kept tokens'
            # scores spread over every token seen, at most `budget`
            bar = self.threshold * sum(score[j] for j in kept - recent) / self.seen
            limit = min(self.budget, len(recent) + sum(1 for j in kept - recent if score[j] >= bar))
            if len(kept) > limit:
                kept.intersection_update(sorted(kept, key=lambda j: (j in recent, score[j], j), reverse=True)[:limit])


class BruteForceTOVA(BruteForce):
    """Oren et al.: the last query's attention, averaged over every query head of the layer."""

    name = "tova_bruteforce"

    def rule(self, layer, b, calls):
        kept = self.kept[(layer, b, 0)]
        assert all(self.kept[(layer, b, h)] == kept for h in calls)  # one layer-wide selection
        last = {h: rows[-1][2] for h, (_, rows) in calls.items()}  # the call's last query, per KV head
        score = {j: mean(mean(head.get(j, 0.0) for head in last[h]) for h in calls) for j in kept}
        for h in calls:
            self.keep_best(layer, b, h, key=lambda j: score[j])


class BruteForceSnapKV(BruteForce):
    """Li et al.: pooled attention of the prompt's last `window` queries; window and generated tokens kept."""

    name = "snapkv_bruteforce"

    def __init__(self, budget, window, kernel, pooling="avg", decode="keep"):
        super().__init__(budget)
        self.window, self.kernel, self.pooling, self.decode = window, kernel, pooling, decode

    def rule(self, layer, b, calls):
        for h in calls:
            self.keep_best(layer, b, h, key=self.snap_key(layer, b, h, calls[h]))

    def snap_key(self, layer, b, h, call):
        """Update the head's window scores from this call; return its keep-priority key over kept indices."""
        new, rows = call
        data = self.data.setdefault((layer, b, h), {"obs": {}, "prompt": set()})
        kept = self.kept[(layer, b, h)]
        if len(rows) > self.window:  # a prompt: score everything by the observation window
            observers = rows[-self.window :]
            data["obs"] = {j: sum(mean(head.get(j, 0.0) for head in heads) for _, _, heads in observers) for j in kept}
            data["prompt"] = set(kept) - set(new[-self.window :])
        elif self.decode == "evict_oldest":
            data["prompt"] = set()
        prompt = sorted(j for j in kept if j in data["prompt"])  # in position order
        obs = [data["obs"][j] for j in prompt]
        pad = self.kernel // 2
        padded = [0.0] * pad + obs + [0.0] * pad
        windows = [padded[k : k + self.kernel] for k in range(len(obs))]
        pooled = [sum(w) / self.kernel if self.pooling == "avg" else max(w) for w in windows]
        score = dict(zip(prompt, pooled, strict=True))
        # prompt tokens by pooled score (ties: the older goes), below every window/generated token (by recency)
        return lambda j: (0, score[j], j) if j in score else (1, 0.0, j)


class BruteForceAdaKV(BruteForceSnapKV):
    """Feng et al.: SnapKV's scores; at a row's first eviction each head keeps floor(alpha * budget) of its
    own best, the rest of the layer's heads x budget go to the best (head, token) pairs; fixed afterwards."""

    name = "adakv_bruteforce"

    def __init__(self, budget, window, kernel, alpha, pooling="avg", decode="keep"):
        super().__init__(budget, window, kernel, pooling, decode)
        self.alpha = alpha

    def rule(self, layer, b, calls):
        keys = {h: self.snap_key(layer, b, h, calls[h]) for h in calls}
        budgets = self.data.get((layer, b, "budgets"))
        if budgets is None and any(len(self.kept[(layer, b, h)]) > self.budget for h in calls):
            budgets = self.data[(layer, b, "budgets")] = self.allocate(layer, b, keys)
        for h in calls:
            kept = self.kept[(layer, b, h)]
            keep = budgets[h] if budgets else self.budget
            if len(kept) > keep:
                kept.intersection_update(sorted(kept, key=keys[h], reverse=True)[:keep])

    def allocate(self, layer, b, keys):
        floor = math.floor(self.alpha * self.budget)
        forced, pool = {}, []
        for h, key in keys.items():
            ranked = sorted(self.kept[(layer, b, h)], key=key, reverse=True)
            pinned = sum(1 for j in ranked if key(j)[0] == 1)
            forced[h] = min(max(floor, pinned), self.budget, len(ranked))
            for j in ranked[forced[h] :]:
                kind, pooled, _ = key(j)
                pool.append((math.inf if kind == 1 else pooled, self.position[b][j], -h))
        rest = self.budget * len(keys) - sum(forced.values())
        chosen = sorted(pool, reverse=True)[:rest]  # best score, then the newer token, then the lower head
        return {h: forced[h] + sum(1 for *_, g in chosen if -g == h) for h in keys}


class BruteForceScissorhands(BruteForce):
    """Liu et al.: decayed count of below-uniform attention over a history window w; r recent kept."""

    name = "scissorhands_bruteforce"

    def __init__(self, budget, slack, history_window, recent):
        super().__init__(budget, slack)
        self.w, self.recent = history_window, recent

    def rule(self, layer, b, calls):
        for h, (_new, rows) in calls.items():
            count = self.data.setdefault((layer, b, h), {})
            kept = self.kept[(layer, b, h)]
            decay = (1 - 1 / self.w) ** len(rows)
            for j in kept:
                count[j] = count.get(j, 0.0) * decay
            if len(rows) > self.w:  # a prompt: its last w queries, on the group's mean row
                for _, cols, heads in rows[-self.w :]:
                    for j in cols:
                        count[j] += mean(head[j] for head in heads) < 1 / len(cols)
            else:  # each query head's own row, averaged over the group
                for _, cols, heads in rows:
                    for j in cols:
                        count[j] += mean(head[j] < 1 / len(cols) for head in heads)
            recent = min(self.recent, self.budget)
            self.keep_best(layer, b, h, key=lambda j: (self.age(j, b) <= recent, -count[j], j))


class BruteForceLazy(BruteForce):
    """Zhang et al. (LazyEviction): per token, the queries since its last recall and its longest such silence that
    ended in a recall; evict every `window` tokens, overdue tokens first, then the ones expected back last."""

    name = "lazy_bruteforce"

    def __init__(self, budget, window, threshold):
        super().__init__(budget, slack=window - 1)
        self.window, self.threshold = window, threshold

    def rule(self, layer, b, calls):
        for h, (_new, rows) in calls.items():
            data = self.data.setdefault((layer, b, h), {"quiet": {}, "gap": {}})
            quiet, gap = data["quiet"], data["gap"]
            for _, cols, heads in rows[-self.window :]:  # a prompt is observed through its last queries
                for j in cols:
                    quiet[j] = quiet.get(j, 0) + 1
                    if mean(head[j] for head in heads) * len(cols) >= self.threshold:  # a recall
                        gap[j] = max(gap.get(j, 0), quiet[j])
                        quiet[j] = 0
            self.keep_best(layer, b, h, key=lambda j, quiet=quiet, gap=gap: self.lazy_key(j, b, quiet, gap))

    def lazy_key(self, j, b, quiet, gap):
        """Pinned if among the `window` newest; then expected back (quiet <= gap) before overdue; expected ones by
        how soon, overdue ones by how little; then the newer."""
        silent, longest = quiet.get(j, 0), gap.get(j, 0)
        expected = silent <= longest
        pinned = self.age(j, b) <= min(self.window, self.budget)
        return (pinned, expected, silent - longest if expected else longest - silent, j)


class BruteForceD2O(BruteForceH2O):
    """Wan et al. (D2O): H2O's ranking; each layer's budget the recipe's times exp(-sparsity) over the mean of the
    layers' (sparsity: 1 - effective tokens / tokens of each KV head's accumulated attention, averaged over the heads),
    read over the tokens seen before the layer first evicts, fixed at the row's first eviction once every layer has a
    weight (before that: the recipe's budget); each evicted token merged into its most cosine-similar kept key when that similarity
    reaches the head's EMA threshold, as the weighted mean (exp(similarity) for it, e for the kept token); with
    ``proportional``, a key standing for n tokens (itself and those merged into it) gets log n on its logits.
    ``sparsity="head_range"``: a layer's sparsity is each KV head's variance of accumulated attention over its tokens,
    min-max normalized over the layer's heads, averaged (the authors' code)."""

    name = "d2o_bruteforce"

    def __init__(self, budget, recent_ratio=0.5, ema_keep=0.5, ema_new=0.5, layer_budgets=True, keep_mass=False,
                 head_budgets=None, proportional=False, sparsity="effective"):
        super().__init__(budget, recent_ratio)
        self.head_budgets = head_budgets  # per KV head (the recipe's budget per head), or None: `budget` for all
        self.ratio, self.ema_keep, self.ema_new, self.layer_budgets = recent_ratio, ema_keep, ema_new, layer_budgets
        self.keep_mass = keep_mass  # weights scaled by the tokens each stands for (itself and those merged into it)
        self.proportional, self.sparsity = proportional, sparsity
        self.mass = {}  # (layer, row, kv head, index) -> tokens merged into it
        self.weights = {}  # (layer, row) -> exp(-sparsity), until the row's budget in that layer is set
        self.budgets = {}  # (layer, row) -> the row's budget in that layer, once fixed
        self.tau = {}  # (layer, row, kv head) -> threshold
        self.merges = 0  # tokens merged, over the run
        self.layer_count: int | None = None  # the model's layers (set by the test): budgets wait for all their weights
        self.passes = {}  # (layer, row) -> forward passes seen
        self.first_eviction = {}  # layer -> the pass in which one of its rows first evicted

    def logit_bias(self, layer, b, h, j):
        return math.log(1 + self.mass.get((layer, b, h, j), 0)) if self.proportional else 0.0

    def rule(self, layer, b, calls):
        score_of = {}
        for h, (_, rows) in calls.items():
            score = self.data.setdefault((layer, b, h), {})
            for _, cols, heads in rows:
                for j in cols:
                    score[j] = score.get(j, 0.0) + mean(head[j] for head in heads)
            score_of[h] = score
        self.passes[(layer, b)] = now = self.passes.get((layer, b), 0) + 1
        evicted_before = self.first_eviction.get(layer, now) < now  # by any row of the layer, in an earlier pass
        if (layer, b) not in self.budgets and not evicted_before:  # weights over the tokens seen before evicting
            sparsity = []
            for h, score in score_of.items():
                values = [score[j] for j in self.kept[(layer, b, h)]]
                total = sum(values)
                if self.sparsity == "head_range":
                    sparsity.append(variance(values) if len(values) > 1 else 0.0)
                else:
                    effective = 1.0 / sum((v / total) ** 2 for v in values)  # tokens it would spread evenly over
                    sparsity.append(1.0 - effective / len(values))
            if self.sparsity == "head_range":
                low, high = min(sparsity), max(sparsity)
                sparsity = [(v - low) / (high - low + 1e-6) for v in sparsity]
            self.weights[(layer, b)] = math.exp(-mean(sparsity))
        recipe = self.head_budgets or [self.budget] * len(calls)
        known = [w for (other, row), w in self.weights.items() if row == b]
        if self.layer_budgets and self.layer_count is None:
            raise ValueError("BruteForceD2O: set layer_count to the model's layers")
        everyone = not self.layer_budgets or len(known) == self.layer_count
        if (layer, b) not in self.budgets and everyone and any(len(self.kept[(layer, b, h)]) > recipe[h] for h in calls):
            share = self.weights[(layer, b)] / mean(known) if self.layer_budgets else 1.0
            self.budgets[(layer, b)] = [max(1, round(limit * share)) for limit in recipe]
        budgets = self.budgets.get((layer, b), recipe)
        for h, score in score_of.items():
            budget, kept = budgets[h], self.kept[(layer, b, h)]
            if len(kept) <= budget:
                continue
            recent = set(sorted(kept, reverse=True)[: round(budget * self.ratio)])
            stay = set(sorted(kept, key=lambda j: (j in recent, score[j]), reverse=True)[:budget])
            self.merge(layer, b, h, sorted(kept - stay), sorted(stay))
            kept.intersection_update(stay)
            self.first_eviction.setdefault(layer, now)

    def merge(self, layer, b, h, leaving, stay):
        def cosine(i, j):
            x, y = self.key[b, h, i].double(), self.key[b, h, j].double()
            return float(x @ y / (x.norm().clamp(min=1e-12) * y.norm().clamp(min=1e-12)))

        best = {i: max((cosine(i, j), j) for j in stay) for i in leaving}
        average = mean(u for u, _ in best.values())
        tau = self.tau.get((layer, b, h))
        tau = average if tau is None else self.ema_keep * tau + self.ema_new * average
        self.tau[(layer, b, h)] = tau
        def stands_for(j):  # itself and the tokens merged into it
            return 1 + self.mass.get((layer, b, h, j), 0)

        def weighs(j):
            return stands_for(j) if self.keep_mass else 1

        into = {}
        for i, (u, j) in best.items():
            if u >= tau:
                into.setdefault(j, []).append((math.exp(u) * weighs(i), i))
        for j, sources in into.items():
            own = math.e * weighs(j)
            total = own + sum(w for w, _ in sources)
            for tensor in (self.key, self.value):
                tensor[b, h, j] = (own * tensor[b, h, j] + sum(w * tensor[b, h, i] for w, i in sources)) / total
            self.mass[(layer, b, h, j)] = self.mass.get((layer, b, h, j), 0) + sum(stands_for(i) for _, i in sources)
            self.merges += len(sources)


class BruteForceRoCo(BruteForce):
    """Ren & Zhu: temporal mean and std of attention; evict the lowest mean among the most stable tokens."""

    name = "roco_bruteforce"

    def __init__(self, budget, recent_ratio, sink_length, recent_tokens):
        super().__init__(budget)
        self.recent_ratio, self.sinks, self.recent_tokens = recent_ratio, sink_length, recent_tokens

    def rule(self, layer, b, calls):
        for h, (_new, rows) in calls.items():
            data = self.data.setdefault((layer, b, h), {})
            kept = self.kept[(layer, b, h)]
            for _, cols, heads in rows:
                for j in cols:
                    s, q, c = data.get(j, (0.0, 0.0, 0))
                    data[j] = (s + mean(head[j] for head in heads), q + mean(head[j] ** 2 for head in heads), c + 1)
            if len(kept) <= self.budget:
                continue
            mu = {j: data[j][0] / data[j][2] for j in kept}
            sigma = {j: math.sqrt(max(data[j][1] / data[j][2] - mu[j] ** 2, 0.0)) for j in kept}
            for j in kept:
                if self.position[b][j] < self.sinks or self.age(j, b) <= self.recent_tokens:
                    sigma[j] = math.inf
            protected = min(self.sinks + math.floor(self.budget * self.recent_ratio), self.budget)
            stable_first = sorted(kept, key=lambda j: (sigma[j], j))
            scope = stable_first[: len(kept) - protected]
            evict = sorted(scope, key=lambda j: (mu[j], j))[: len(kept) - self.budget]
            kept.difference_update(evict)


class BruteForceFastGen(BruteForce):
    """Ge et al.: each head's cheapest pattern recovering T of its prompt attention (per query head, reduced
    by min or mean over the group), then kept while decoding: special/punct tokens, the ceil(r_l L) newest,
    and the ceil(r_f L) most attended of the rest. Per-query local masks are applied one (query, key) at a time."""

    name = "fastgen_bruteforce"
    BITS = {"special": 1, "punct": 2, "frequency": 4, "local": 8}

    def __init__(self, special, punct, threshold=0.95, local_ratio=0.3, frequency_ratio=0.3, recovery="mass",
                 gqa="min", candidates=("special", "special+punct", "special+punct+frequency",
                                        "special+punct+frequency+local", "full"), pattern=None, sinks=0):
        super().__init__(budget=0)
        self.special, self.punct, self.sinks = set(special), set(punct), sinks
        self.target = threshold if recovery == "mass" else (1 + threshold) / 2
        self.r_l, self.r_f, self.gqa = local_ratio, frequency_ratio, gqa
        self.candidates = [set(c.split("+")) for c in candidates]
        if {"full"} not in self.candidates:
            self.candidates.append({"full"})
        self.pattern = None if pattern is None else set(pattern.split("+"))
        self.ids: list[list[int]] = []  # per row: the token id at every padded index so far
        self.patterns: dict[tuple[int, int, int], str] = {}

    def hook(self, model):
        """Record every forward pass's input ids (the reference attention sees no ids)."""

        def record(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not self.ids or ids.shape[0] != len(self.ids):
                self.ids = [[] for _ in range(ids.shape[0])]
            for b, row in enumerate(ids.tolist()):
                self.ids[b] += row

        return model.register_forward_pre_hook(record, with_kwargs=True)

    def share(self, ratio, tokens):
        return max(1, math.ceil(ratio * tokens - 1e-9))

    def sets(self, b, kept):
        special = {j for j in kept if self.ids[b][j] in self.special or self.position[b][j] < self.sinks}
        punct = {j for j in kept if self.ids[b][j] in self.punct}
        return special, punct

    def rule(self, layer, b, calls):
        for h, (_new, rows) in calls.items():
            kept = self.kept[(layer, b, h)]
            acc = self.data.setdefault((layer, b, h), {})
            for _, cols, heads in rows:
                for j in cols:
                    acc[j] = acc.get(j, 0.0) + mean(head[j] for head in heads)
            if (layer, b, h) not in self.patterns:
                self.patterns[(layer, b, h)] = self.profile(b, kept, acc, rows)
            pattern = set(self.patterns[(layer, b, h)].split("+"))
            if "full" in pattern:
                continue
            seen = self.seen
            special, punct = self.sets(b, kept)
            fixed = set()
            if "special" in pattern:
                fixed |= special
            if "punct" in pattern:
                fixed |= punct
            if "local" in pattern:
                fixed |= {j for j in kept if seen - self.position[b][j] <= self.share(self.r_l, seen)}
            top = []
            if "frequency" in pattern:
                top = sorted(kept - fixed, key=lambda j: (-acc[j], j))[: self.share(self.r_f, seen)]
            kept.intersection_update(fixed | set(top))

    def profile(self, b, kept, acc, rows):
        if self.pattern is not None:
            return "+".join(sorted(self.pattern))
        n, seen = len(rows), self.seen
        window, frequent = self.share(self.r_l, seen), self.share(self.r_f, seen)
        special, punct = self.sets(b, kept)
        newest = {j for j in kept if seen - self.position[b][j] <= window}
        best, best_cost = None, math.inf
        for candidate in self.candidates:
            if candidate == {"full"}:
                recovery, cost = 1.0, len(kept)
            else:
                chosen = set()
                if "special" in candidate:
                    chosen |= special
                if "punct" in candidate:
                    chosen |= punct
                if "frequency" in candidate:
                    excluded = chosen | (newest if "local" in candidate else set())
                    chosen |= set(sorted(kept - excluded, key=lambda j: (-acc[j], j))[:frequent])
                local = "local" in candidate
                masses = []
                for g in range(len(rows[0][2])):
                    total = 0.0
                    for i, cols, heads in rows:
                        for j in cols:
                            near = local and self.position[b][i] - self.position[b][j] < window
                            if j in chosen or near:
                                total += heads[g][j]
                    masses.append(total / n)
                recovery = min(masses) if self.gqa == "min" else mean(masses)
                cost = len(chosen | newest) if local else len(chosen)
            if recovery >= self.target - 1e-9 and cost < best_cost:
                best, best_cost = candidate, cost
        return "+".join(sorted(best))


class BruteForceKVzip(BruteForce):
    """Kim et al.: once the prompt is in, the model repeats it in probe passes of ``request`` + ``suffix`` + a chunk
    of the prompt (from the second chunk on ``request_next`` + the last 8 tokens of the chunk before), each pass seeing
    the prompt and its own tokens alone; a prompt token scores the most attention any real probe query of any query
    head gave it. Nothing is evicted before that; then each head keeps its first ``sinks`` tokens, the tokens after
    the prompt (newest first) and its best-scoring prompt tokens, ``budget`` in all. ``heads_share``: AdaKV's split
    with no floor (kvzip-ada): at a row's first eviction each layer's heads x budget go to its pinned tokens and then
    to its best (head, prompt token) scores, fixed from then on. ``model_share`` (kvzip-global): the model's layers x
    heads x budget go to its pinned tokens and then to its best (layer, head, prompt token) scores, each head keeping
    what it won."""

    name = "kvzip_bruteforce"

    def __init__(self, budget, sinks, chunk, request, request_next, suffix, heads_share=False, model_share=False):
        super().__init__(budget)
        self.sinks, self.chunk, self.heads_share, self.model_share = sinks, chunk, heads_share, model_share
        self.request, self.request_next, self.suffix = request, request_next, suffix
        self.probing, self.probed = False, False
        self.scores: dict[tuple[int, int, int], dict[int, float]] = {}
        self.budgets: dict[tuple[int, int, int], int] = {}

    def passes(self, prompt: list[int]) -> list[list[int]]:
        chunks = [prompt[i : i + self.chunk] for i in range(0, len(prompt), self.chunk)]
        return [(self.request if i == 0 else self.request_next + chunks[i - 1][-8:]) + self.suffix + chunk
                for i, chunk in enumerate(chunks)]

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if not self.probing:
            return super().attention(module, query, key, value, attention_mask, scaling, **kwargs)
        layer = module.layer_idx
        batch, q_heads, queries, dim = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        group, scaling = q_heads // kv_heads, scaling or dim**-0.5
        real = attention_mask.bool()[:, -total:]
        first_new = total - queries
        out = torch.zeros(batch, queries, q_heads, dim)
        for b in range(batch):
            for h in range(kv_heads):
                prompt = [j for j in range(first_new) if real[b, j]]
                best = self.scores.setdefault((layer, b, h), {})
                for i in range(first_new, total):
                    if not real[b, i]:
                        continue
                    cols = prompt + [j for j in range(first_new, i + 1) if real[b, j]]
                    for g in range(group):
                        probs = attend_one(query, key, value, out, b, h * group + g, i - first_new, cols, scaling)
                        for j, p in zip(cols, probs, strict=True):
                            if j < first_new:
                                best[j] = max(best.get(j, 0.0), p)
        return out.to(query.dtype), None

    def priority(self, layer, b, h):
        score = self.scores.get((layer, b, h), {})
        return lambda j: ((3, j) if self.position[b][j] < self.sinks else (2, j) if j not in score
                          else (1, score[j]))

    def pinned(self, layer, b, h) -> set[int]:
        return {j for j in self.kept[(layer, b, h)] if self.priority(layer, b, h)(j)[0] > 1}

    def worth(self, layer, b, h, j) -> float:
        return self.scores[(layer, b, h)][j]

    def rule(self, layer, b, calls):
        if not self.probed:
            return  # the prompt waits for the probe
        for h in calls:
            kept = self.kept[(layer, b, h)]
            budget = self.budgets.get((layer, b, h), self.budget)
            if len(kept) > budget:
                kept.intersection_update(sorted(kept, key=self.priority(layer, b, h), reverse=True)[:budget])

    def evict_after_probe(self, layers, batch, heads):
        if self.model_share:
            for b in range(batch):
                entries = sorted(((self.priority(layer, b, h)(j), layer, h) for layer in range(layers)
                                  for h in range(heads) for j in self.kept[(layer, b, h)]), reverse=True)
                won = entries[: layers * heads * self.budget]
                for layer in range(layers):
                    for h in range(heads):
                        self.budgets[(layer, b, h)] = sum(1 for _, ll, hh in won if (ll, hh) == (layer, h))
        for layer in range(layers):
            for b in range(batch):
                if self.heads_share and sum(len(self.kept[(layer, b, h)]) for h in range(heads)) > heads * self.budget:
                    pinned = {h: self.pinned(layer, b, h) for h in range(heads)}
                    pairs = sorted(((self.worth(layer, b, h, j), h, j) for h in range(heads)
                                    for j in self.kept[(layer, b, h)] if j not in pinned[h]), key=lambda t: -t[0])
                    room = heads * self.budget - sum(min(len(p), self.budget) for p in pinned.values())
                    chosen = pairs[:room]
                    for h in range(heads):
                        self.budgets[(layer, b, h)] = min(len(pinned[h]), self.budget) + sum(
                            1 for _, hh, _ in chosen if hh == h)
                self.rule(layer, b, range(heads))
            self.current[layer] = [[sorted(self.position[b][j] for j in self.kept[(layer, b, h)])
                                    for h in range(heads)] for b in range(batch)]

    def hook(self, model):
        """Run the probe right after the prompt's forward pass, as kvpolicy's session does, with this attention."""

        def after(module, args, kwargs, output):
            if self.probing or self.probed:
                return
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            width = ids.shape[1]
            rows = [[t for t, m in zip(r, mr, strict=True) if m] for r, mr in zip(ids.tolist(), mask.tolist(), strict=True)]
            passes = [self.passes(row) for row in rows]
            self.probing = True
            for index in range(max(len(p) for p in passes)):
                chunks = [p[index] if index < len(p) else [] for p in passes]
                wide = max(1, max(len(c) for c in chunks))
                new = torch.tensor([[0] * (wide - len(c)) + [1] * len(c) for c in chunks])
                probe = torch.tensor([[0] * (wide - len(c)) + c for c in chunks])
                positions = torch.tensor([[len(row)] for row in rows]) + (new.cumsum(dim=1) - 1).clamp(min=0)
                model(input_ids=probe, attention_mask=torch.cat([mask, new], dim=1), position_ids=positions,
                      use_cache=True, **{cache_keyword(model): cache})
                for layer in cache.layers:  # the pass's tokens leave
                    layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
            self.probing, self.probed = False, True
            config = model.config
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            self.evict_after_probe(config.num_hidden_layers, ids.shape[0], heads)

        return model.register_forward_hook(after, with_kwargs=True)


class BruteForceH2OKVzip(BruteForceKVzip):
    """H2O's rule (the newest ``round(budget x recent_ratio)`` kept, then the highest score) where a prompt token's
    score is KVzip's probe maximum plus the attention (mean over the query heads) of every query after the prompt,
    and a later token's score that attention alone; ``heads_share``: AdaKV's split as in `BruteForceKVzip` (the split
    pins the recipe's recent window, each head then the share of its own budget)."""

    name = "h2o_kvzip_bruteforce"

    def __init__(self, budget, recent_ratio, chunk, request, request_next, suffix, heads_share=False):
        super().__init__(budget, 0, chunk, request, request_next, suffix, heads_share)
        self.ratio, self.recent = recent_ratio, round(budget * recent_ratio)
        self.later: dict[tuple[int, int, int], dict[int, float]] = {}

    def pinned(self, layer, b, h) -> set[int]:
        return set(sorted(self.kept[(layer, b, h)], reverse=True)[: self.recent])

    def worth(self, layer, b, h, j) -> float:
        return self.scores.get((layer, b, h), {}).get(j, 0.0) + self.later.get((layer, b, h), {}).get(j, 0.0)

    def rule(self, layer, b, calls):
        if not self.probed:
            return
        for h in calls:
            later = self.later.setdefault((layer, b, h), {})
            for _, cols, heads in calls[h][1] if isinstance(calls, dict) else ():
                for j in cols:
                    later[j] = later.get(j, 0.0) + mean(head[j] for head in heads)
            kept = self.kept[(layer, b, h)]
            budget = self.budgets.get((layer, b, h), self.budget)
            recent = set(sorted(kept, reverse=True)[: round(budget * self.ratio)])  # the share of the head's own budget
            if len(kept) > budget:
                kept.intersection_update(sorted(kept, key=lambda j: (j in recent, self.worth(layer, b, h, j)),
                                                reverse=True)[:budget])


def rope_matrix(position: int, dim: int, theta: float) -> list[list[float]]:
    """RoPE's rotation at ``position`` as an explicit dim x dim matrix (rotate-half layout: pair i with i + dim/2)."""
    half = dim // 2
    matrix = [[0.0] * dim for _ in range(dim)]
    for i in range(half):
        angle = position * theta ** (-2 * i / dim)
        c, s = math.cos(angle), math.sin(angle)
        matrix[i][i], matrix[i][i + half] = c, -s
        matrix[i + half][i], matrix[i + half][i + half] = s, c
    return matrix


def apply(matrix, vector) -> list[float]:
    return [sum(m * v for m, v in zip(row, vector, strict=True)) for row in matrix]


class BruteForceExpectedAttention(BruteForce):
    """Devoto et al.: every query of every call kept as Python floats (times the scaling), its RoPE undone by the
    transposed rotation matrix of its position; a query head's mean and covariance over the queries at positions
    >= ``sinks`` (older ones weighing ``decay`` per query counted since); the rotation averaged over the next
    ``future`` positions as an explicit matrix R; a token's expected attention exp(k . R m + k^T R S R^T k / 2),
    normalized over the head's kept tokens but the sinks, averaged over its query heads, times its value norm. The first ``sinks``
    tokens and the newest ``recent_ratio`` x budget are pinned."""

    name = "expected_attention_bruteforce"

    def __init__(self, budget, sinks, future, theta, covariance=True, recent_ratio=0.0, decay=1.0):
        super().__init__(budget)
        self.sinks, self.future, self.theta, self.covariance = sinks, future, theta, covariance
        self.recent, self.decay = round(budget * recent_ratio), decay
        self.queries: dict[tuple[int, int, int], list[tuple[float, list[float]]]] = {}  # (layer, b, q head)

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, (batch, q_heads, queries, dim) = module.layer_idx, query.shape
        scaling = scaling or dim**-0.5
        total = key.shape[2]
        real = torch.ones(batch, total, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, -total:]
        position = (torch.cumsum(real.long(), dim=1) - 1).tolist()
        for b in range(batch):
            counted = [i for i in range(total - queries, total) if real[b, i] and position[b][i] >= self.sinks]
            for qh in range(q_heads):
                seen = [(w * self.decay ** len(counted), q) for w, q in self.queries.get((layer, b, qh), [])]
                for i in counted:
                    back = [list(col) for col in zip(*rope_matrix(position[b][i], dim, self.theta), strict=True)]
                    vector = [float(x) * scaling for x in query[b, qh, i - (total - queries)]]
                    seen.append((1.0, apply(back, vector)))
                self.queries[(layer, b, qh)] = seen
        self.dim, self.group = dim, q_heads // key.shape[1]
        return super().attention(module, query, key, value, attention_mask, scaling, **kwargs)

    def rule(self, layer, b, calls):
        dim, group = self.dim, self.group
        ahead = [rope_matrix(t, dim, self.theta) for t in range(self.seen, self.seen + self.future)]
        turn = [[sum(m[r][c] for m in ahead) / self.future for c in range(dim)] for r in range(dim)]
        for h in calls:
            kept = self.kept[(layer, b, h)]
            expected = {j: 0.0 for j in kept}
            for g in range(group):
                queries = self.queries.get((layer, b, h * group + g), [])
                weight = max(sum(w for w, _ in queries), 1.0)
                mean = [sum(w * q[d] for w, q in queries) / weight for d in range(dim)]
                cov = [[sum(w * q[r] * q[c] for w, q in queries) / weight - mean[r] * mean[c] for c in range(dim)]
                       for r in range(dim)]
                center = apply(turn, mean)
                spread = [apply(turn, row) for row in zip(*[apply(turn, row) for row in cov], strict=True)]
                logits = {}
                for j in (j for j in kept if self.position[b][j] >= self.sinks):
                    k = [float(x) for x in self.key[b, h, j]]
                    logits[j] = sum(a * c for a, c in zip(k, center, strict=True))
                    if self.covariance:
                        logits[j] += 0.5 * sum(a * s for a, s in zip(k, apply(spread, k), strict=True))
                top = max(logits.values())
                norm = sum(math.exp(x - top) for x in logits.values())
                for j in logits:
                    expected[j] += math.exp(logits[j] - top) / norm / group
            worth = {j: expected[j] * float(self.value[b, h, j].norm()) for j in kept}
            recent = set(sorted(kept, reverse=True)[: self.recent])
            self.keep_best(layer, b, h, key=lambda j: (self.position[b][j] < self.sinks or j in recent, worth[j]))
