"""Argument checks of the cache's public entry points, written once: each raises the typed error that says
what to do, and returns the value in the form the components use (plain ints, lists of ints)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import DTypeError, PositionError, SequenceError, ShapeError, SpecError

END = 2**62  # "to the end" of a range: past any sequence
F32_MAX = float(np.finfo(np.float32).max)


def is_int(x: Any) -> bool:
    """A real integer: int or numpy integer, never a bool (True is not layer 1) nor an integral float."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_bool(x: Any, what: str, error: type[Exception] = ShapeError) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise error(f"{what} must be a bool, got {x!r}")
    return bool(x)


def count(x: Any, what: str, minimum: int = 0, error: type[Exception] = SpecError) -> int:
    """An int >= ``minimum``."""
    if not is_int(x) or x < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise error(f"{what} must be {kind}, got {x!r}")
    return int(x)


def layer(x: Any, n_layers: int) -> int:
    if not is_int(x):
        raise PositionError(f"layer must be an int, got {type(x).__name__} {x!r}")
    if not 0 <= x < n_layers:
        raise PositionError(f"layer {x!r} is out of range; the cache has layers 0..{n_layers - 1}")
    return int(x)


def position(p: Any, what: str, allow_none: bool = True) -> Any:
    if p is None and allow_none:
        return None
    if not is_int(p):
        extra = " or None" if allow_none else ""
        raise PositionError(f"{what} must be an int{extra}, got {type(p).__name__} {p!r}")
    return int(p)


def pos_range(p0: Any, p1: Any) -> tuple[int, int]:
    """llama.cpp's ``[p0, p1)``: p0 < 0 is the start, p1 None or < 0 the end."""
    p0 = position(p0, "p0", allow_none=False)
    p1 = position(p1, "p1")
    lo = 0 if p0 < 0 else p0
    hi = END if p1 is None or p1 < 0 else p1
    if hi < lo:
        raise PositionError(f"range [{p0}, {p1}) is empty backwards; need p0 <= p1 (or p1 < 0 for the end)")
    return lo, hi


def stored_range(p0: Any, p1: Any, length: int, what: str) -> tuple[int, int]:
    """``[p0, p1)`` within ``length`` stored tokens (``p1`` None or < 0: the end)."""
    p0 = position(p0, "p0", allow_none=False)
    p1 = position(p1, "p1")
    hi = length if p1 is None or p1 < 0 else p1
    if not (0 <= p0 <= hi <= length):
        raise PositionError(f"{what}: range [{p0}, {hi}) is outside the {length} tokens stored")
    return p0, hi


def seq_ids(seqs: Any) -> list[Any]:
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
        raise SequenceError(f"seqs must be a list of sequence ids, got {type(seqs).__name__}")
    return list(seqs)


def tiers(value: Any) -> list[Any]:
    if value is None:
        return []
    from .tiers import Tier

    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SpecError(f"tiers must be a list of kvhal.tiers tiers, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, Tier):
            raise SpecError(f"tiers[{i}] is a {type(t).__name__}, not a kvhal.tiers.Tier (HostTier, DiskTier, ...)")
    return list(value)


def token_ids(value: Any) -> list[int]:
    """Token ids as plain ints in [0, 2**31): a list/tuple of ints or a 1-d integer array."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise ShapeError(f"token_ids must be a 1-d integer array, got {value.dtype} of shape {value.shape}")
        ids = value.tolist()
    elif hasattr(value, "__dlpack__") or type(value).__module__.startswith("torch"):
        from .interop import to_numpy

        return token_ids(to_numpy(value))
    elif isinstance(value, (list, tuple)):
        # plain ints (the common case) pass on one cheap type test; a bool's type is bool, not int
        if all(type(t) is int for t in value):
            ids = list(value)
        elif all(is_int(t) for t in value):
            ids = [int(t) for t in value]
        else:
            bad = next(t for t in value if not is_int(t))
            raise ShapeError(f"token_ids must hold ints, got {type(bad).__name__} {bad!r}")
    else:
        raise ShapeError(f"token_ids must be a list of ints or a 1-d integer array, got {type(value).__name__}")
    if ids and (min(ids) < 0 or max(ids) >= 2**31):
        raise ShapeError(f"token ids must be in [0, 2**31); got min {min(ids)}, max {max(ids)}")
    return ids


def kv_rows(k: Any, v: Any, n_kv_heads: int, head_dim: int) -> int:
    """The token count of a store's ``k``, ``v`` ``[n_new, n_kv_heads, head_dim]``."""
    expect = (n_kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        if len(x.shape) != 3 or tuple(x.shape[1:]) != expect:
            raise ShapeError(
                f"{name} has shape {tuple(x.shape)}; expected [n_new, {expect[0]}, {expect[1]}] "
                "(tokens, n_kv_heads, head_dim)"
            )
    if k.shape[0] != v.shape[0]:
        raise ShapeError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}; store both for the same tokens")
    return int(k.shape[0])


def queries(q: Any, head_dim: int, n_kv_heads: int, n_seqs: int, q_lens: Any) -> list[int]:
    """Check ``q [sum(q_lens), n_heads, head_dim]`` against ``q_lens`` (default: all rows for one sequence, one
    row each for several); returns the per-sequence query counts as plain ints."""
    if len(q.shape) != 3 or q.shape[2] != head_dim:
        raise ShapeError(f"q has shape {tuple(q.shape)}; expected [sum(q_lens), n_heads, {head_dim}]")
    n_heads = int(q.shape[1])
    if n_heads == 0 or n_heads % n_kv_heads:
        raise ShapeError(f"q has {n_heads} heads, not a multiple of the cache's {n_kv_heads} KV heads (GQA needs one)")
    if q_lens is None:
        if q.shape[0] == 0:  # as q_lens=[0] is: a sequence with no query has nothing to attend for
            raise ShapeError("q has no rows; attention needs at least one query per sequence")
        if n_seqs != 1 and q.shape[0] != n_seqs:
            raise ShapeError("pass q_lens when attending over several sequences with more than one query each")
        return [int(q.shape[0])] if n_seqs == 1 else [1] * n_seqs
    if isinstance(q_lens, (str, bytes)) or not isinstance(q_lens, (Sequence, np.ndarray)):
        raise ShapeError(f"q_lens must be a list of ints, got {type(q_lens).__name__}")
    if not all(is_int(n) for n in q_lens):
        raise ShapeError(f"q_lens must hold ints, got {list(q_lens)!r}")
    # plain ints: numpy calls on these few-element arrays cost more than the checks themselves
    qls = [int(n) for n in q_lens]
    if len(qls) != n_seqs or min(qls) < 1:
        raise ShapeError(f"q_lens must hold one positive count per sequence; got {list(q_lens)} for {n_seqs} seqs")
    if sum(qls) != q.shape[0]:
        raise ShapeError(f"q has {q.shape[0]} rows but q_lens sums to {sum(qls)}")
    return qls


def attention_options(scale: Any, causal: Any, window: Any, observe: Any, head_dim: int) -> tuple[float, int | None]:
    """The call's scale (default ``1/sqrt(head_dim)``) and window, after checking all four."""
    # past END a window covers any sequence; refused there so no backend meets an int beyond int64
    if window is not None and (not is_int(window) or not 1 <= window <= END):
        raise ShapeError(f"window must be a positive int up to 2**62 (or None for no window), got {window!r}")
    check_bool(causal, "causal")
    check_bool(observe, "observe")
    if scale is None:
        return 1.0 / math.sqrt(head_dim), None if window is None else int(window)
    try:
        # kernels take the scale as float32: one past its range would reach them as inf (NaN rows)
        finite = math.isfinite(scale) and abs(scale) <= F32_MAX
    except (OverflowError, TypeError):  # an int beyond float's range; a non-number (refused below)
        finite = False
    if (
        not isinstance(scale, (int, float, np.integer, np.floating))
        or isinstance(scale, (bool, np.bool_))
        or not finite
    ):
        raise ShapeError(f"scale must be a finite real number within float32's range, or None; got {scale!r}")
    return float(scale), None if window is None else int(window)


def stored_rows(x: Any, what: str, n_kv_heads: int, row_bytes: int) -> np.ndarray:
    """Already-stored rows as host uint8 ``[n, n_kv_heads, row_bytes]`` (the pool's row byte layout): a uint8
    numpy array of that shape or ``[n, n_kv_heads * row_bytes]``, or ``bytes``/``bytearray``/``memoryview``
    of whole tokens (a str is not bytes)."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(x, np.uint8)
    elif isinstance(x, np.ndarray) and x.dtype == np.uint8:
        arr = x
    else:
        dtype = getattr(x, "dtype", None)
        raise DTypeError(
            f"{what} is a {type(x).__name__}{f' of {dtype}' if dtype is not None else ''}; pass the stored rows as "
            "a uint8 numpy array [n, n_kv_heads, row_bytes] or bytes (store() takes float values)"
        )
    token = n_kv_heads * row_bytes
    if arr.ndim == 1 and arr.size % token == 0:
        return arr.reshape(-1, n_kv_heads, row_bytes)
    if arr.ndim == 2 and arr.shape[1] == token:
        return arr.reshape(-1, n_kv_heads, row_bytes)
    if arr.ndim == 3 and arr.shape[1:] == (n_kv_heads, row_bytes):
        return arr
    raise ShapeError(
        f"{what} has shape {arr.shape}; expected [n, {n_kv_heads}, {row_bytes}] (n_kv_heads, bytes per head row) "
        f"or whole tokens of {token} bytes"
    )


def load_dtype(dtype: Any) -> str | None:
    """``load``'s ``dtype``: None or one of interop.OUT_DTYPES."""
    from .interop import OUT_DTYPES

    if dtype is not None and (not isinstance(dtype, str) or dtype not in OUT_DTYPES):
        raise DTypeError(f"dtype must be None or one of {', '.join(map(repr, OUT_DTYPES))}, got {dtype!r}")
    return dtype


def load_out(out: Any, dtype: str | None, shape: tuple[int, int, int]) -> Any:
    """``load``'s ``out``: a (k, v) pair of writable, C-contiguous, non-overlapping host buffers of ``shape`` and
    one dtype (``dtype`` when given), as an ``interop.LoadOut``."""
    from .interop import LoadOut, host_out_view

    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ShapeError(f"out must be a (k, v) pair of arrays, got {type(out).__name__}")
    (k, kd), (v, vd) = host_out_view(out[0], "out[0] (k)"), host_out_view(out[1], "out[1] (v)")
    if kd != vd or (dtype is not None and kd != dtype):
        want = f"dtype={dtype!r}" if dtype is not None else "one dtype"
        raise DTypeError(f"out has dtypes {kd} (k) and {vd} (v); they must match {want}")
    for what, a in (("out[0] (k)", k), ("out[1] (v)", v)):
        if a.shape != shape:
            raise ShapeError(f"{what} has shape {a.shape}; this load returns {shape} (positions, kv heads, head_dim)")
        if not a.flags.c_contiguous:
            raise ShapeError(f"{what} is not C-contiguous; pass a contiguous buffer (np.empty / torch.empty)")
        if not a.flags.writeable:
            raise SpecError(f"{what} is read-only; pass a writable buffer")
    if k.size and np.may_share_memory(k, v):
        raise SpecError("out[0] (k) and out[1] (v) overlap; pass two separate buffers")
    return LoadOut(k, v, kd, (out[0], out[1]))
