"""DLPack in, numpy out: the only array conversions the core needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DTypeError, KVHalError, ShapeError, SpecError


def _not_an_array(x: Any, what: str = "x") -> DTypeError:
    return DTypeError(
        f"{what} is {'None' if x is None else 'a ' + type(x).__name__}, not an array; pass a numpy, torch, cupy or "
        "pyopencl array (or anything with __dlpack__)"
    )


def to_numpy(x: Any) -> np.ndarray:
    """Any backend's output (numpy, torch, cupy, pyopencl arrays) as a host numpy array.

    A numpy array comes back as it is; a CPU torch tensor as a numpy view of its memory (a lazily negated or
    conjugated view resolved first), a torch bfloat16 tensor widened exactly to float32 (numpy has no bfloat16).
    A (rectangular) nested list of numbers is taken as ``np.asarray`` takes it. Raises DTypeError for what holds no
    array of numbers: None, a str, a ragged list, a sparse or meta tensor, a dtype numpy cannot hold.
    """
    if isinstance(x, np.ndarray):
        return x
    if x is None or isinstance(x, (str, bytes)):
        raise _not_an_array(x)
    module = type(x).__module__.split(".")[0]
    try:
        if module == "torch":
            import torch  # already imported: x comes from torch

            if isinstance(x, torch.Tensor):
                return _torch_to_numpy(x, torch)
        if module in ("cupy", "pyopencl") or hasattr(x, "get") and hasattr(x, "shape") and not hasattr(x, "__dlpack__"):
            arr = np.asarray(x.get())
        elif hasattr(x, "__dlpack__"):
            arr = np.from_dlpack(x)
        else:
            arr = np.asarray(x)
    except KVHalError:
        raise
    except (TypeError, ValueError, RuntimeError, NotImplementedError, BufferError, AttributeError) as e:
        raise DTypeError(
            f"x ({type(x).__module__}.{type(x).__name__}) could not be read as a host array ({e}); pass a numpy, "
            "torch, cupy or pyopencl array (or anything with __dlpack__), or a rectangular list of numbers"
        ) from e
    if arr.dtype.kind in "OSU":
        raise DTypeError(
            f"x ({type(x).__name__}) holds {arr.dtype} values, not numbers; pass a numeric array or list of numbers"
        )
    return arr


def _torch_to_numpy(x: Any, torch: Any) -> np.ndarray:
    t = x.detach()
    if not t.is_cpu:
        if t.device.type == "meta":
            raise DTypeError("x is a meta tensor: it has a shape but no values; pass a tensor that holds data")
        t = t.to("cpu")
    if t.layout != torch.strided:
        raise DTypeError(f"x is a {t.layout} tensor; convert it with .to_dense() first")
    if t.dtype == torch.bfloat16:  # numpy has no bf16; widening is exact
        t = t.float()
    if t.is_neg() or t.is_conj():  # a lazy view: numpy() would refuse it
        t = t.resolve_conj().resolve_neg()
    return t.numpy()


def to_like(x: Any, like: Any) -> Any:
    """``x`` (a backend's output) in the array library and on the device of ``like`` (the caller's input).

    torch in, torch out: a host numpy result becomes a CPU tensor sharing its memory (``torch.from_numpy``; one in
    a layout torch cannot share, such as non-native byte order, is copied), a device array goes through DLPack
    without a copy when it already sits on ``like``'s device, another backend output (a pyopencl array) through
    ``to_numpy``. Anything else comes back as it is. Raises DTypeError where ``like`` is a torch object but not a
    tensor, or ``x`` is not an array of numbers.
    """
    if type(like).__module__.split(".")[0] != "torch":
        return x
    import torch  # already imported: ``like`` comes from torch
    from torch.utils.dlpack import from_dlpack

    if not isinstance(like, torch.Tensor):
        raise DTypeError(
            f"like is a {type(like).__module__}.{type(like).__name__}, not a tensor; pass the tensor (or array) whose "
            "library and device the result should have"
        )
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
        t = _numpy_to_torch(to_numpy(x), torch)
    else:
        try:
            t = from_dlpack(x)
        except (TypeError, ValueError, RuntimeError, BufferError) as e:
            raise DTypeError(
                f"x ({type(x).__module__}.{type(x).__name__}) could not be taken through DLPack ({e}); pass a "
                "numpy or torch array, or bring it to the host with kvhal.to_numpy first"
            ) from e
    return t if t.device == like.device else t.to(like.device)


def _numpy_to_torch(x: np.ndarray, torch: Any) -> Any:
    if x.dtype.name == "bfloat16" and x.dtype.itemsize == 2:  # ml_dtypes: torch takes the bits
        return _numpy_to_torch(x.view(np.int16), torch).view(torch.bfloat16)
    try:
        return torch.from_numpy(x)
    except (TypeError, ValueError, RuntimeError) as e:
        if x.dtype.kind not in "biufc":
            raise DTypeError(f"x has dtype {x.dtype}, which torch does not take; pass a numeric array") from e
    try:  # negative strides or non-native byte order: a native, contiguous copy
        return torch.from_numpy(np.ascontiguousarray(x, x.dtype.newbyteorder("=")))
    except (TypeError, ValueError, RuntimeError) as e:
        raise DTypeError(f"x has dtype {x.dtype}, which torch does not take; pass a numeric array") from e


def host_float_array(x: Any, what: str) -> np.ndarray:
    """A host float32/float16 numpy view of ``x`` (numpy, torch CPU tensor, anything with __dlpack__)."""
    if type(x) is np.ndarray and (x.dtype == np.float32 or x.dtype == np.float16):
        return x  # the per-step case: str(dtype) below alone costs microseconds
    dtype = getattr(x, "dtype", None)
    if str(dtype) == "torch.bfloat16":  # numpy has no bf16 to take it through DLPack; widening is exact
        x, dtype = x.float(), "torch.float32"
    elif isinstance(x, np.ndarray) and x.dtype.name == "bfloat16" and x.dtype.itemsize == 2:  # ml_dtypes, as load
        x = x.astype(np.float32)  # returns it (dtype="bfloat16"); exact
        dtype = x.dtype
    if dtype is not None and str(dtype).replace("torch.", "") not in ("float32", "float16"):
        raise DTypeError(
            f"{what} has dtype {dtype}; kvhal takes float32, float16 or bfloat16 (convert with .float() or .astype('float32'))"
        )
    if isinstance(x, (str, bytes)):
        raise DTypeError(f"{what} is a {type(x).__name__}, not an array; pass a float32/float16 array")
    try:
        arr = to_numpy(x) if dtype is not None else np.asarray(x)
    except (TypeError, BufferError, RuntimeError, ValueError) as e:
        raise DTypeError(
            f"{what} could not be read as a float array ({e}); pass a CPU float32/float16 array "
            "(numpy, torch, or anything with __dlpack__), not a ragged list"
        ) from e
    if dtype is None:  # nested lists: numbers only (asarray(x, float32) would take "1.5" and True as values)
        if arr.dtype.kind not in "fiu":
            raise DTypeError(f"{what} holds {arr.dtype} values, not numbers; pass a float32/float16 array")
        arr = arr.astype(np.float32)
    if arr.dtype not in (np.float32, np.float16):
        raise DTypeError(f"{what} has dtype {arr.dtype}; kvhal takes float32, float16 or bfloat16")
    return arr


# ---- load outputs: host buffers a caller hands to ``KVCache.load(out=...)`` ---------------------------------------

OUT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoadOut:
    """A checked ``out`` of ``KVCache.load``: the numpy views the backend writes (bfloat16 as uint16 bits), their
    dtype name, and the caller's own objects, which the call returns."""

    k: np.ndarray
    v: np.ndarray
    dtype: str
    result: tuple[Any, Any]


def host_out_view(x: Any, what: str) -> tuple[np.ndarray, str]:
    """A writable numpy view of the caller's output buffer ``x`` (numpy array, ``ml_dtypes.bfloat16`` array or CPU
    torch tensor) and its dtype name, one of OUT_DTYPES; bfloat16 comes back as its uint16 bits. Raises DTypeError
    for another array type or dtype (a non-native byte order, a sparse or negated/conjugated-view tensor included),
    UnsupportedError for a tensor off the host."""
    from ..errors import UnsupportedError

    module = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        name = x.dtype.name
        if name in OUT_DTYPES and not x.dtype.isnative:  # '>f4' is named float32 too: load would write swapped bytes
            raise DTypeError(
                f"{what} has dtype {x.dtype.str} (non-native byte order); pass a native-byte-order array "
                f"(np.empty(shape, {name!r}))"
            )
        view = x.view(np.uint16) if name == "bfloat16" and x.dtype.itemsize == 2 else x
    elif module == "torch" and hasattr(x, "device"):
        import torch  # already imported: x is a tensor

        if not isinstance(x, torch.Tensor):
            raise DTypeError(
                f"{what} is a {type(x).__module__}.{type(x).__name__}; out takes numpy arrays or CPU torch tensors"
            )
        if x.device.type != "cpu":
            raise UnsupportedError(
                f"{what} is a torch tensor on {x.device}; load writes host memory: pass a CPU tensor (or a numpy "
                "array) and move it to the device afterwards"
            )
        if x.layout != torch.strided:
            raise DTypeError(f"{what} is a {x.layout} tensor; pass a dense (strided) CPU tensor (torch.empty)")
        if x.is_neg() or x.is_conj():
            raise DTypeError(
                f"{what} is a lazily negated/conjugated view; pass a plain tensor (torch.empty), not a view of one"
            )
        name = str(x.dtype).replace("torch.", "")
        if name not in OUT_DTYPES:
            raise DTypeError(f"{what} has dtype {name}; load writes {', '.join(OUT_DTYPES)}")
        t = x.detach()
        view = t.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else t.numpy()
    else:
        raise DTypeError(
            f"{what} is a {type(x).__module__}.{type(x).__name__}; out takes numpy arrays or CPU torch tensors"
        )
    if name not in OUT_DTYPES:
        raise DTypeError(f"{what} has dtype {name}; load writes {', '.join(OUT_DTYPES)}")
    return view, name


def bf16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``x`` rounded to bfloat16 (nearest even; NaN stays a quiet NaN of its sign), as uint16 bits (into
    ``out``, a uint16 array of x's size, when given). In chunks that stay in the caches: no full-size temporaries."""
    u = np.ascontiguousarray(x, np.float32).reshape(-1).view(np.uint32)
    res = np.empty(u.size, np.uint16) if out is None else out.reshape(-1)
    chunk = 1 << 16
    r = np.empty(min(chunk, u.size), np.uint32)
    for i in range(0, u.size, chunk):
        src, t = u[i : i + chunk], r[: min(chunk, u.size - i)]
        np.right_shift(src, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        t += 0x7FFF
        t += src
        t >>= 16
        nan = (src & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        if nan.any():
            t[nan] = (src[nan] >> 16) | 0x40
        res[i : i + len(t)] = t
    return res.reshape(np.shape(x))


def cast_into(dst: np.ndarray, dtype: str, src: np.ndarray) -> None:
    """Write f32 ``src`` into a view ``host_out_view`` returned (``dtype`` its name), rounding to nearest even.
    Raises DTypeError, ShapeError or SpecError (before writing anything) where ``dst`` is not such a view: not a
    numpy array, not of ``src``'s shape, read-only, or ``dtype`` not one of OUT_DTYPES."""
    if not isinstance(dst, np.ndarray):
        raise DTypeError(f"cast_into writes a numpy view (host_out_view's), got {type(dst).__name__}")
    if dtype not in OUT_DTYPES:
        raise DTypeError(f"cast_into writes {', '.join(OUT_DTYPES)}, got dtype {dtype!r}")
    if dtype == "bfloat16" and (dst.dtype != np.uint16 or not dst.flags.c_contiguous):
        raise DTypeError(f"a bfloat16 out is written as C-contiguous uint16 bits (host_out_view's), got {dst.dtype}")
    if dtype != "bfloat16" and (dst.dtype.name != dtype or not dst.dtype.isnative):
        raise DTypeError(f"cast_into was told {dtype} for an out of dtype {dst.dtype.str}")
    if np.shape(src) != dst.shape:
        raise ShapeError(f"cast_into got src of shape {np.shape(src)} for an out of shape {dst.shape}")
    if not dst.flags.writeable:
        raise SpecError("cast_into got a read-only out; pass a writable buffer")
    if dtype == "bfloat16":
        bf16_bits(src, dst)
    else:
        np.copyto(dst, src, casting="unsafe")
