"""An offline lm-eval task from real text: which sentence comes next after a long passage.

    python -m kvpolicy.lmeval.local_task --out tasks/ [--text-file FILE] [--docs 40] [--context-words 450]

writes ``kvp_next_sentence.yaml`` and its data (``kvp_next_sentence.jsonl``) into ``--out``: each
document is a passage of the text (the CPython documentation topics by default) followed by
four candidate sentences, the one that really follows and three drawn from far away in the
text. lm-eval scores it as multiple choice (``acc``, ``acc_norm``); the model must have read the
passage to prefer the true continuation, so evicting the wrong tokens of a long passage costs
accuracy. Then: ``python -m kvpolicy.lmeval run ... --tasks kvp_next_sentence --include_path tasks/``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TASK = "kvp_next_sentence"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def sentences(text: str) -> list[str]:
    """The text's prose sentences (code, tables and short fragments dropped), whitespace collapsed."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        if not flat or flat.startswith((">>>", "...", "*", "=", "+", "|")):
            continue
        found.extend(s for s in _SENTENCE_END.split(flat) if 8 <= len(s.split()) <= 40 and s[-1] in ".!?")
    return found


def documents(text: str, count: int, context_words: int, seed: int) -> list[dict]:
    """``count`` documents: a passage of about ``context_words`` words, four choices, the index of the true one."""
    pool = sentences(text)
    if len(pool) < 200:
        raise ValueError(f"the text has {len(pool)} prose sentences; it needs at least 200")
    rng = random.Random(seed)
    docs: list[dict] = []
    for _ in range(count):
        end = rng.randrange(len(pool) // 4, len(pool) - 1)  # the passage ends before sentence `end`
        start, words = end, 0
        while start > 0 and words < context_words:
            start -= 1
            words += len(pool[start].split())
        far = [i for i in rng.sample(range(len(pool)), 40) if abs(i - end) > 50][:3]
        choices = [pool[end]] + [pool[i] for i in far]
        rng.shuffle(choices)
        docs.append({"passage": " ".join(pool[start:end]), "choices": [" " + c for c in choices],
                     "answer": choices.index(pool[end])})
    return docs


def write_task(folder: Path, docs: list[dict]) -> Path:
    """The task's YAML and JSON lines in ``folder``; returns the YAML's path."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    config = folder / f"{TASK}.yaml"
    config.write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data.resolve()}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{passage}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n",
        encoding="utf-8",
    )
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the task (give it to lm-eval's --include_path)")
    parser.add_argument("--text-file", help="the text (default: the CPython documentation topics)")
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--context-words", type=int, default=450)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.text_file:
        text = Path(args.text_file).read_text(encoding="utf-8")
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
    try:
        docs = documents(text, args.docs, args.context_words, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(write_task(Path(args.out), docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
