"""The key-value header of a GGUF model file, read directly (``gguf.GGUFReader`` parses every tensor first:
seconds for a small model), and what ``kvhal convert --model`` needs of it: layers, KV heads, head dims, and a
sha256 of the file for the fingerprint."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import LlamaStateUnsupportedError, SpecError


def _path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise SpecError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (the header only, not its tensors): GGUF's documented layout,
    read directly because ``gguf.GGUFReader`` parses every tensor first (seconds for a small model)."""
    p = _path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise SpecError(f"cannot open GGUF model {p!r}: {e}") from None

    def take(n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise SpecError(f"{p!r} ends inside its GGUF header: not a complete GGUF model")
        return b

    def scalar(t: int) -> Any:
        if t == 8:
            (n,) = struct.unpack("<Q", take(8))
            return take(n).decode("utf-8", "replace")
        if t not in _GGUF_SCALARS:
            raise SpecError(f"{p!r}: GGUF value type {t} is unknown (corrupt header?)")
        fmt = _GGUF_SCALARS[t]
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    with f:
        magic, version = take(4), struct.unpack("<I", take(4))[0]
        if magic != b"GGUF" or version < 2:
            raise SpecError(f"{p!r} is not a GGUF v2+ model (magic {magic!r}, version {version})")
        _, n_kv = struct.unpack("<QQ", take(16))
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            (n,) = struct.unpack("<Q", take(8))
            key = take(n).decode("utf-8", "replace")
            (t,) = struct.unpack("<I", take(4))
            if t == 9:
                et, count = struct.unpack("<IQ", take(12))
                if et in _GGUF_SCALARS and et != 8:  # numbers in one read (token tables are long)
                    fmt = _GGUF_SCALARS[et]
                    out[key] = list(np.frombuffer(take(count * struct.calcsize(fmt)), fmt))
                else:
                    out[key] = [scalar(et) for _ in range(count)]
            else:
                out[key] = scalar(t)
    return out


def model_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a GGUF model says of its KV cache: name, architecture, layers, KV heads, K and V head sizes, and a
    sha256 of the file (the fingerprint's model name is ``name@sha256``)."""
    p = _path(path)
    meta = gguf_metadata(p)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise SpecError(f"{p!r} has no general.architecture; not a llama.cpp model")

    def one(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if isinstance(v, list):
            if len({int(x) for x in v}) != 1:
                raise LlamaStateUnsupportedError(f"{p!r}: {key} differs between layers ({sorted(set(v))})")
            v = v[0]
        return None if v is None else int(v)

    n_layers, heads, kv, n_embd = (
        one(k) for k in ("block_count", "attention.head_count", "attention.head_count_kv", "embedding_length")
    )
    kv = kv if kv is not None else heads
    if n_layers is None or heads is None or kv is None or n_embd is None:
        raise SpecError(f"{p!r}: no block_count/head_count/embedding_length for architecture {arch!r}")
    head_k = one("attention.key_length") or n_embd // heads
    head_v = one("attention.value_length") or n_embd // heads
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    name = meta.get("general.name") or Path(p).stem
    return {
        "name": name,
        "architecture": arch,
        "n_layers": n_layers,
        "n_kv_heads": kv,
        "head_dim_k": head_k,
        "head_dim_v": head_v,
        "sha256": h.hexdigest(),
        "fingerprint": f"{name}@{h.hexdigest()}",
    }
