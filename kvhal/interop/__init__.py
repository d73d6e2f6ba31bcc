"""DLPack in, numpy out: the only array conversions the core needs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DTypeError


def to_numpy(x: Any) -> np.ndarray:
    """Any backend's output (numpy, torch, cupy, pyopencl arrays) as a host numpy array."""
    if isinstance(x, np.ndarray):
        return x
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return x.detach().to("cpu").numpy()
    if module in ("cupy", "pyopencl") or hasattr(x, "get") and hasattr(x, "shape") and not hasattr(x, "__dlpack__"):
        return np.asarray(x.get())
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x)
    return np.asarray(x)


def to_like(x: Any, like: Any) -> Any:
    """``x`` (a backend's output) in the array library and on the device of ``like`` (the caller's input).

    torch in, torch out: a host numpy result becomes a CPU tensor sharing its memory (``torch.from_numpy``),
    a device array goes through DLPack without a copy when it already sits on ``like``'s device. Anything
    else comes back as it is.
    """
    if type(like).__module__.split(".")[0] != "torch":
        return x
    import torch  # already imported: ``like`` is a torch tensor
    from torch.utils.dlpack import from_dlpack

    if isinstance(x, np.ndarray):
        t = torch.from_numpy(x)
    elif isinstance(x, torch.Tensor):
        t = x
    else:
        t = from_dlpack(x)
    return t if t.device == like.device else t.to(like.device)


def host_float_array(x: Any, what: str) -> np.ndarray:
    """A host float32/float16 numpy view of ``x`` (numpy, torch CPU tensor, anything with __dlpack__)."""
    if type(x) is np.ndarray and (x.dtype == np.float32 or x.dtype == np.float16):
        return x  # the per-step case: str(dtype) below alone costs microseconds
    dtype = getattr(x, "dtype", None)
    if str(dtype) == "torch.bfloat16":  # numpy has no bf16 to take it through DLPack; widening is exact
        x, dtype = x.float(), "torch.float32"
    if dtype is not None and str(dtype).replace("torch.", "") not in ("float32", "float16"):
        raise DTypeError(
            f"{what} has dtype {dtype}; kvhal takes float32, float16 or bfloat16 (convert with .float() or .astype('float32'))"
        )
    if isinstance(x, (str, bytes)):
        raise DTypeError(f"{what} is a {type(x).__name__}, not an array; pass a float32/float16 array")
    try:
        arr = to_numpy(x) if dtype is not None else np.asarray(x, dtype=np.float32)
    except (TypeError, BufferError, RuntimeError, ValueError) as e:
        raise DTypeError(
            f"{what} could not be read as a float array ({e}); pass a CPU float32/float16 array "
            "(numpy, torch, or anything with __dlpack__), not a ragged list"
        ) from e
    if arr.dtype not in (np.float32, np.float16):
        raise DTypeError(f"{what} has dtype {arr.dtype}; kvhal takes float32, float16 or bfloat16")
    return arr
