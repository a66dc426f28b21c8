"""``python -m kvpolicy.lmeval run --model kvpolicy --model_args pretrained=smollm2,recipe=h2o,budget=0.2 --tasks ...``

lm-eval's command line (the same arguments as ``lm_eval``), with the ``kvpolicy`` model type registered first.
"""

from __future__ import annotations

import sys


def check_model_args(argv: list[str]) -> None:
    """A bad recipe or budget in ``--model_args`` of ``--model kvpolicy`` fails now, not after lm-eval has spent
    ~15 s indexing its tasks."""
    from lm_eval.utils import simple_parse_args_string

    from .model import checked_arguments

    def value(flag: str) -> str | None:
        for index, word in enumerate(argv):
            if word == flag and index + 1 < len(argv):
                return argv[index + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
        return None

    if value("--model") != "kvpolicy":
        return
    try:
        args = simple_parse_args_string(value("--model_args") or "")
    except Exception:  # a form lm-eval reads differently (JSON): it is checked when the model is built
        return
    checked_arguments(**{k: v for k, v in args.items() if k in ("recipe", "budget", "dtype")})


def main(argv: list[str] | None = None) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != "lm_eval":
            raise
        print('kvpolicy: error: this command needs lm-eval, which is not installed: pip install "kvpolicy[lmeval]"',
              file=sys.stderr)
        return 2
    from ..errors import KVPolicyError
    from . import model  # noqa: F401  (registers the "kvpolicy" model type)

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        check_model_args(sys.argv[1:])
        cli_evaluate()
    except KVPolicyError as error:  # a bad recipe, budget, model folder: one line, as the kvpolicy command says it
        print(f"kvpolicy: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
