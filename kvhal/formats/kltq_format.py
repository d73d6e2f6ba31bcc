"""The kltq budgets in the registry: ``kltq:2`` .. ``kltq:8``, one name per offered budget (``kltq.names()``).

A record is ``bits * head_dim / 8`` bytes (``kltq.row_bytes``), so the registry's blocks are 16 values of
``2 * bits`` bytes and ``bits_per_element`` is the budget: everything stored per value (no per-token scale;
the side data is per cache, not per value). The bytes mean something only with the cache's side data
(``kltq.Side``), so ``Format.quantize``/``dequantize`` refuse: a cache runs the codec.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import FormatError
from . import Format, register
from .kltq import BUDGETS, PREFIX

BLOCK_LEN = 16  # values per registry block: 2 * bits bytes for every budget in steps of 1/2


def _refuse(name: str) -> Callable[[np.ndarray], np.ndarray]:
    def refuse(_: np.ndarray) -> np.ndarray:
        raise FormatError(
            f"{name} rows mean something only with a cache's side data (kvhal.formats.kltq.Side): store and load "
            "them through a KVCache, or call kltq.quantize/dequantize with the side data"
        )

    return refuse


for _bits in BUDGETS:
    _name = f"{PREFIX}:{_bits:g}"
    register(
        Format(
            _name, BLOCK_LEN, int(2 * _bits), float(np.finfo(np.float32).max), _refuse(_name), _refuse(_name),
            side_data=True,
        )
    )  # fmt: skip
