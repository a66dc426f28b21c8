"""Variable tracking (RULER's ``vt``): follow a chain of assignments VAR A = 12345, VAR B = VAR A, ... through noise.

One chain of ``hops`` + 1 five-letter variables is hidden, one assignment per line, among
noise lines, in order and at sorted random depths; the question (after the context) gives
the value and asks for every variable that holds it. A one-shot example, a short solved
instance with other names, comes before the task, as in RULER.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .haystack import TextHaystack, noise_lines
from .niah import DEPTH_GRID
from .prompt import Draft, Sample, finish, fit, insert_at_depths
from .words import variable_name

EXAMPLE_LINES = 6


@dataclass(frozen=True)
class VariableTracking:
    chains: int = 1
    hops: int = 4
    max_new_tokens: int = 30

    @property
    def description(self) -> str:
        return f"variable tracking: {self.chains} chain of {self.hops} hops in noise; name every variable in it"

    def _chains(self, rng: random.Random) -> list[tuple[list[str], str, list[str]]]:
        """(variables, value, assignment lines) per chain; all names distinct."""
        names: list[str] = []
        while len(names) < self.chains * (self.hops + 1):
            name = variable_name(rng)
            if name not in names:
                names.append(name)
        out = []
        for c in range(self.chains):
            chain = names[c * (self.hops + 1) : (c + 1) * (self.hops + 1)]
            value = str(rng.randint(10000, 99999))
            lines = [f"VAR {chain[0]} = {value}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]}" for j in range(self.hops)]
            out.append((chain, value, lines))
        return out

    def _texts(self, context: str, value: str) -> tuple[str, str]:
        task_text = ("Memorize and follow the chains of variable assignments hidden in the text below.\n\n"
                     f"{context}\nQuestion: Find all variables that are assigned the value {value} in the text above.")
        prefix = (" Answer: According to the chains of variable assignments in the text above, "
                  f"{self.hops + 1} variables are assigned the value {value}, they are: ")
        return task_text, prefix

    def _example(self, rng: random.Random) -> str:
        chains = self._chains(rng)
        lines = noise_lines(EXAMPLE_LINES)
        for offset, line in enumerate(chains[0][2]):
            lines.insert(min(len(lines), offset * 2), line)
        task_text, prefix = self._texts("\n".join(lines), chains[0][1])
        return f"{task_text}{prefix}{' '.join(chains[0][0])}\n"

    def sample(self, name: str, tokenizer: Any, text: TextHaystack, length: int, index: int, count: int,
               seed: Any) -> Sample:
        rng = random.Random(f"{name}-{seed}-{length}-{index}")
        example = self._example(random.Random(f"{name}-{seed}-{length}-{index}-example"))
        chains = self._chains(rng)
        needles = []
        for _, _, lines in chains:
            depths = sorted(rng.sample(DEPTH_GRID, len(lines)))
            needles += list(zip(lines, depths, strict=True))
        variables, value, _ = chains[0]

        def draft(size: int) -> Draft:
            context = insert_at_depths(noise_lines(size), needles, "\n")
            task_text, prefix = self._texts(context, value)
            return Draft(example + task_text, context, prefix, list(variables), needles, needles[0][1])

        made = fit(tokenizer, length, draft, least=1)
        return finish(tokenizer, made, task=name, length=length, index=index, max_new_tokens=self.max_new_tokens)
