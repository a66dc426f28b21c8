"""RULER's synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?"), generated locally from a seed and a haystack text, as ``kvpolicy compare`` tasks.

The eleven tasks keep RULER's names and settings (its ``synthetic.yaml``); the two QA tasks
are left out (they need the SQuAD and HotpotQA data sets). ``SUITES`` names the sets
``--suite`` runs. How these differ from RULER is listed in docs/ruler.md.
"""

from __future__ import annotations

from .niah import NeedleInAHaystack
from .task import RulerTask
from .variable_tracking import VariableTracking
from .word_counts import CommonWords, FrequentWords

#: name -> (generator, table header)
GENERATORS = {
    "niah_single_1": (NeedleInAHaystack("noise", "words", "numbers"), "s1"),
    "niah_single_2": (NeedleInAHaystack("essay", "words", "numbers"), "s2"),
    "niah_single_3": (NeedleInAHaystack("essay", "words", "uuids"), "s3"),
    "niah_multikey_1": (NeedleInAHaystack("essay", "words", "numbers", keys=4), "mk1"),
    "niah_multikey_2": (NeedleInAHaystack("needle", "words", "numbers"), "mk2"),
    "niah_multikey_3": (NeedleInAHaystack("needle", "uuids", "uuids"), "mk3"),
    "niah_multivalue": (NeedleInAHaystack("essay", "words", "numbers", values=4), "mv"),
    "niah_multiquery": (NeedleInAHaystack("essay", "words", "numbers", queries=4), "mq"),
    "vt": (VariableTracking(chains=1, hops=4), "vt"),
    "cwe": (CommonWords(), "cwe"),
    "fwe": (FrequentWords(alpha=2.0), "fwe"),
}

RULER_TASKS: dict[str, RulerTask] = {name: RulerTask(name, gen, header) for name, (gen, header) in GENERATORS.items()}

SUITES: dict[str, list[str]] = {
    # the needle and aggregation tasks SmolLM2-135M can do at 1K tokens (not vt, cwe: 0% and 4% with the full cache)
    "ruler-small": ["niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "fwe"],
    "ruler": list(GENERATORS),
}

__all__ = ["GENERATORS", "RULER_TASKS", "SUITES", "RulerTask"]
