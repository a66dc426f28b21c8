"""Built-in policies, registered through the same hook third-party plugins use."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .adakv import AdaKV
from .d2o import D2O
from .expected_attention import ExpectedAttention
from .fastgen import FastGen
from .full import Full
from .h2o import H2O
from .h2o_kvzip import H2OKVzip, H2OKVzipAda
from .kvzip import KVzip, KVzipAda
from .kvzip_global import KVzipGlobal
from .lazy import Lazy
from .roco import RoCo
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA
from .window import Window


@hookimpl
def kvpolicy_register_policies() -> list[type]:
    return [Full, Window, Streaming, H2O, Scissorhands, RoCo, TOVA, SnapKV, AdaKV, FastGen, Lazy, D2O, KVzip, KVzipAda, KVzipGlobal,
            H2OKVzip, H2OKVzipAda, ExpectedAttention]
