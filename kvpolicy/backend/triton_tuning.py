"""The Triton kernels' tuning spaces: block sizes, warps and stages that ``triton.autotune`` chooses among on a GPU.

Each space is a list of dicts in the keys of `triton_kernels._configs` (``dec_n``, ``dec_warps``,
...), so one entry can also be passed to ``attend_tracking_triton(config=...)`` by hand: the tests run
every distinct block size of every space under the interpreter against the torch reference. On a
GPU the autotuned kernels time each entry once per tuning key (head size, rows, a power-of-two
bucket of the length, dtypes) and keep the fastest; `AUTOTUNE_ENV` = 0 turns that off (the fixed
`_configs` choice then runs).

The decode split length is a multiple of every decode block (`DECODE_SPLIT_MULTIPLE`), so a split
never ends inside a block whatever block the tuner picks.
"""

from __future__ import annotations

import os
from itertools import product

import triton

AUTOTUNE_ENV = "KVPOLICY_TRITON_AUTOTUNE"

#: decode, one program per (split of the key slots, row x KV head)
DECODE_SPACE = [dict(dec_n=n, dec_warps=w, dec_stages=s) for n, w, s in product((32, 64, 128), (2, 4, 8), (2, 3, 4))
                if not (n == 32 and w == 8)]
DECODE_SPLIT_MULTIPLE = 128
#: prefill forward (flash with log-sum-exp), one program per block of queries of one query head
FORWARD_SPACE = [dict(fwd_m=m, fwd_n=n, fwd_warps=w, fwd_stages=s)
                 for m, n, w, s in product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if not (m == 64 and w == 8)]
#: prefill statistics, one program per block of key slots of one (row, KV head)
STATS_SPACE = [dict(stats_m=m, stats_n=n, stats_warps=w, stats_stages=s)
               for m, n, w, s in product((32, 64, 128), (64, 128), (4, 8), (2, 3)) if not (m == 32 and w == 8)]


def autotuning() -> bool:
    """Autotune on a GPU unless ``KVPOLICY_TRITON_AUTOTUNE=0``."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def length_bucket(length: int) -> int:
    """The tuning key of a length: its next power of two (so a growing cache re-tunes log2(T) times, not per step)."""
    return triton.next_power_of_2(max(int(length), 1))


def _triton_configs(space: list[dict], block_names: dict[str, str], warps: str, stages: str) -> list[triton.Config]:
    return [triton.Config({name: entry[key] for key, name in block_names.items()}, num_warps=entry[warps],
                          num_stages=entry[stages]) for entry in space]


def tuned(kernel, space: list[dict], block_names: dict[str, str], warps: str, stages: str, key: list[str],
          reset_to_zero: list[str] | None = None):
    """``kernel`` under ``triton.autotune`` over ``space`` (``block_names``: space key -> kernel constexpr)."""
    configs = _triton_configs(space, block_names, warps, stages)
    return triton.autotune(configs=configs, key=key, reset_to_zero=reset_to_zero)(kernel)
