"""Aggregation tasks: common-words extraction (RULER's ``cwe``) and frequent-words extraction (``fwe``).

``cwe``: a numbered list of words in which 10 words appear often (30 times each, 3 for the
others; 6 and 1 below 4,096 tokens, as RULER) and the rest rarely; name the 10 common ones.
A solved one-shot example with other words comes first.

``fwe``: a "coded text" of made-up 6-letter words whose counts follow a Zipf law (word k
appears N k^-alpha / zeta(alpha) times); the most frequent is replaced by "...." noise,
and the answer is the next three. Neither task has a needle, so neither has a depth.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from ...errors import KVPolicyError
from .haystack import TextHaystack
from .prompt import Draft, Sample, finish, fit
from .words import WORD_POOL, coded_word

#: RULER switches to longer lists (and a longer example) from this length on
LONG = 4096


@dataclass(frozen=True)
class CommonWords:
    common: int = 10
    common_repeats: int = 30
    rare_repeats: int = 3
    max_new_tokens: int = 120

    @property
    def description(self) -> str:
        return f"common words: name the {self.common} words repeated most often in a long numbered list"

    def _texts(self, listing: str) -> tuple[str, str]:
        task_text = ("Below is a numbered list of words. Some of them appear more often than the others. "
                     f"Memorize the ones that appear most often.\n{listing}\nQuestion: What are the "
                     f"{self.common} most common words in the list above?")
        return task_text, f" Answer: The {self.common} words that appear most often in the list are:"

    def _listing(self, pool: list[str], words: int, repeats: tuple[int, int], rng: random.Random):
        chosen = rng.sample(pool, words)
        common, rare = chosen[: self.common], chosen[self.common :]
        items = common * repeats[0] + rare * repeats[1]
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(items)), common

    def sample(self, name: str, tokenizer: Any, text: TextHaystack, length: int, index: int, count: int,
               seed: Any) -> Sample:
        pool = list(dict.fromkeys([*WORD_POOL, *text.vocabulary()]))
        long = length >= LONG
        repeats = (self.common_repeats, self.rare_repeats) if long else (6, 1)
        example_rng = random.Random(f"{name}-{seed}-{length}-{index}-example")
        listing, answer = self._listing(pool, 40 if long else 20, (10, 3) if long else (3, 1), example_rng)
        task_text, prefix = self._texts(listing)
        example = f"{task_text}{prefix} {' '.join(f'{i + 1}. {w}' for i, w in enumerate(answer))}\n"

        def draft(words: int) -> Draft:
            listing, common = self._listing(pool, words, repeats, random.Random(f"{name}-{seed}-{length}-{index}"))
            task_text, prefix = self._texts(listing)
            return Draft(example + task_text, listing, prefix, common)

        most = len(pool)
        made = fit(tokenizer, length, lambda words: draft(min(most, words)), least=self.common + 1)
        sample = finish(tokenizer, made, task=name, length=length, index=index, max_new_tokens=self.max_new_tokens)
        if len(sample.input_ids) < 0.9 * length:  # the search ran out of distinct words
            raise KVPolicyError(f"{name}: {length} tokens needs more distinct words than the {most} available "
                                "(built-in list and the text's): give a smaller --prompt-tokens or a --text-file "
                                "with a larger vocabulary")
        return sample


def zeta(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta(alpha) for alpha > 1: the sum of the first ``terms`` terms plus the integral of the tail."""
    return math.fsum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


@dataclass(frozen=True)
class FrequentWords:
    alpha: float = 2.0
    word_letters: int = 6
    answers: int = 3
    max_new_tokens: int = 50

    @property
    def description(self) -> str:
        return f"frequent words: name the {self.answers} most frequent made-up words of a Zipf-distributed text"

    def sample(self, name: str, tokenizer: Any, text: TextHaystack, length: int, index: int, count: int,
               seed: Any) -> Sample:
        rng = random.Random(f"{name}-{seed}-{length}-{index}")
        vocabulary: list[str] = []
        size = max(self.answers + 2, length // 50)  # RULER: one coded word per 50 tokens
        while len(vocabulary) < size:
            word = coded_word(rng, self.word_letters)
            if word not in vocabulary:
                vocabulary.append(word)
        vocabulary[0] = "...."  # the most frequent word is noise
        norm = zeta(self.alpha)
        order_seed = f"{name}-{seed}-{length}-{index}-order"

        def draft(words: int) -> Draft:
            items = [word for k, word in enumerate(vocabulary, 1) for _ in range(int(words * k**-self.alpha / norm))]
            random.Random(order_seed).shuffle(items)
            coded = " ".join(items)
            task_text = ("Read the coded text below and keep count of each coded word. Find the three coded words "
                         f"that appear most often. {coded}\nQuestion: Give no explanation, and ignore the dots "
                         "'....'. Which three words appear most often in the coded text above?")
            prefix = " Answer: According to the coded text above, the three words that appear most often are:"
            return Draft(task_text, coded, prefix, vocabulary[1 : 1 + self.answers])

        made = fit(tokenizer, length, draft, least=10)
        return finish(tokenizer, made, task=name, length=length, index=index, max_new_tokens=self.max_new_tokens)
