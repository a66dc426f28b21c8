"""``python -m kvpolicy.lmeval run --model kvpolicy --model_args pretrained=smollm2,recipe=h2o,budget=0.2 --tasks ...``

lm-eval's command line (the same arguments as ``lm_eval``), with the ``kvpolicy`` model type registered first.
"""

from __future__ import annotations

import sys


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
        cli_evaluate()
    except KVPolicyError as error:  # a bad recipe, budget, model folder: one line, as the kvpolicy command says it
        print(f"kvpolicy: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
