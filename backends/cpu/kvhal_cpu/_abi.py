"""The kernel library's C interface: ``Args`` mirrors ``kv_args`` (csrc/kvcpu.h) field for field, and
every exported call takes one pointer to it. The library is refused unless its own description of
that struct (``kvc_args_layout``: each field's name, offset, size and kind) and its format table
(``kvc_format_table``) agree with this side: a drifted field or format id is an unavailable backend,
never memory written in the wrong place."""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

from kvhal.backend_util import format_table

ABI_VERSION = 6
ISAS = ("scalar", "avx2", "avx512", "neon", "amx")  # enum order of csrc/kvcpu.h
ERRORS = {-1: "the requested ISA is not supported by this CPU", -2: "out of memory", -3: "invalid arguments"}

_i32, _i64, _f32, _p = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Args(ctypes.Structure):
    """``kv_args``: the first fields describe one layer of one cache, the rest one call."""

    _fields_ = [
        *((name, _i32) for name in ("isa", "threads", "kv_split", "tile", "kfmt", "vfmt")),
        *((name, _i32) for name in ("n_kv_heads", "head_dim", "block_size", "n_heads", "kpaged")),
        ("krow", _i64),
        ("vrow", _i64),
        *((name, _p) for name in ("kpool", "vpool", "k", "v", "slots", "dst_slots", "blocks", "kout", "vout")),
        ("n", _i64),
        ("raw", _p),
        ("raw_stride", _i64),
        *((name, _p) for name in ("q", "out", "lse", "block_table", "seq_lens", "q_lens", "holes")),
        *((name, _i32) for name in ("n_seqs", "max_blocks", "causal", "window")),
        ("scale", _f32),
    ]


_KINDS = {_i32: "i", _i64: "q", _f32: "f", _p: "p"}


def c_window(window: int | None) -> int:
    """A call's window as the kernels' int32 takes it (0: none). kvhal takes windows up to 2**62, which ctypes
    would wrap (2**32 + 1 as 1); any window past int32 covers every sequence (lengths are int32), so it is cut."""
    return 0 if window is None else min(window, 2**31 - 1)


def layout() -> str:
    """``Args`` in the text ``kvc_args_layout`` writes: its size, then each field's name, offset, size, kind."""
    fields = [
        f"{name} {getattr(Args, name).offset} {ctypes.sizeof(kind)} {_KINDS[kind]}" for name, kind in Args._fields_
    ]
    return ";".join([f"kv_args {ctypes.sizeof(Args)}", *fields])


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_kvcpu{suffix}"
        if p.exists():
            return p
    return None


def _declare(lib: ctypes.CDLL) -> None:
    args = ctypes.POINTER(Args)
    sigs: dict[str, tuple[object, list[object]]] = {
        "kvc_abi_version": (_i32, []),
        "kvc_args_layout": (_i32, [ctypes.c_char_p, _i32]),
        "kvc_format_table": (_i32, [ctypes.POINTER(_i32), _i32]),
        "kvc_isa_supported": (_i32, [_i32]),
        "kvc_best_isa": (_i32, []),
        "kvc_scan_f32": (_i32, [_p, _i64, ctypes.POINTER(_f32)]),
        "kvc_store": (_i32, [args]),
        "kvc_load_to": (_i32, [args, _i64, _i32]),
        "kvc_copy_slots": (_i32, [args]),
        "kvc_attention": (_i32, [args]),
        "kvc_attention_mass": (_i32, [args, _i32, _p, _p]),
        "kvc_attention_path": (ctypes.c_char_p, [args, _i32]),
        "kvc_read_blocks": (_i32, [args]),
        "kvc_write_blocks": (_i32, [args]),
    }
    for name, (res, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, argtypes


def library_layout(lib: ctypes.CDLL) -> str:
    buf = ctypes.create_string_buffer(4096)
    n = lib.kvc_args_layout(buf, len(buf))
    if n >= len(buf):
        raise OSError(f"its kv_args layout takes {n} bytes to describe; expected under {len(buf)}")
    return buf.value.decode()


def library_formats(lib: ctypes.CDLL) -> dict[int, tuple[int, int]]:
    """format id -> (block_len, block_bytes) of every format the kernels implement."""
    buf = (_i32 * 3 * 64)()
    n = lib.kvc_format_table(ctypes.cast(buf, ctypes.POINTER(_i32)), 3 * 64)
    return {buf[i][0]: (buf[i][1], buf[i][2]) for i in range(n)}


def open_library(path: Path) -> tuple[ctypes.CDLL, frozenset[str]]:
    """The loaded library and the formats it runs; OSError says why it cannot be used."""
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
    except AttributeError as e:
        raise OSError(f"a symbol is missing ({e})") from None
    if lib.kvc_abi_version() != ABI_VERSION:
        raise OSError(f"ABI version {lib.kvc_abi_version()}, this package expects {ABI_VERSION}")
    theirs, ours = library_layout(lib).split(";"), layout().split(";")
    if theirs != ours:
        diff = next(f"{a!r} where kvhal_cpu has {b!r}" for a, b in zip(theirs + [""], ours + [""]) if a != b)
        raise OSError(f"its kv_args differs from kvhal_cpu's mirror: {diff}")
    registry = {fid: (name, block_len, block_bytes) for name, fid, block_len, block_bytes in format_table()}
    runs = set()
    for fid, sizes in library_formats(lib).items():
        if fid not in registry or registry[fid][1:] != sizes:
            raise OSError(f"its format {fid} {sizes} is not kvhal's {registry.get(fid)} (built for another kvhal)")
        runs.add(registry[fid][0])
    return lib, frozenset(runs)
