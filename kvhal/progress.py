"""A progress bar for long runs: tqdm when installed, a plain counter on stderr otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        for i, item in enumerate(items, 1):
            print(f"\r{desc}: {i}/{total}", end="", file=sys.stderr, flush=True)
            yield item
        print(file=sys.stderr)
        return
    yield from tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False)
