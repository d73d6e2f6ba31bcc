"""llama.cpp sequence state <-> kvhal, byte for byte.

llama.cpp saves one sequence's KV cache with ``llama_state_seq_get_data`` (bytes) and
``llama_state_seq_save_file`` (a file) and loads it with ``llama_state_seq_set_data`` / ``_load_file``. The
layout (``llama-context.cpp`` and ``llama-kv-cache.cpp`` ``state_write``/``state_read``, checked against the
llama.cpp that llama-cpp-python 0.3.36 vendors, commit 0c1e570; docs/design.md spells it out), little-endian:

* bytes: ``u32 0xaf143cd8`` (io magic), ``i32`` source seq id, then the memory state;
* file: ``u32 'ggsq'`` magic, ``u32`` version (3), ``u32 n_tokens``, ``i32 tokens[n_tokens]``, the memory state;
* memory state: one section per KV cache (a sliding-window model writes two: the full-attention layers'
  then the window layers'), each ``u32 n_stream`` then per stream ``u32 cell_count`` and, when not 0: per cell
  ``i32 pos``, ``u32 n_seq_id`` (1), ``i32 seq_id``; ``u32 v_trans``, ``u32 n_layer``; per layer ``i32 ggml
  type``, ``u64 row bytes``, the K rows of every cell; then V: per layer the same (``v_trans`` 0), or
  (``v_trans`` 1, no flash attention) ``i32 type``, ``u32 element bytes``, ``u32 n_embd_v_gqa`` and, element
  by element, that element of every cell.

A K/V row of one token is its KV heads' ggml rows one after another, so a kvhal pool row (one head) is a
slice of it: the bytes move unchanged. llama.cpp multiplies quantized K/V by an unsigned Walsh-Hadamard
matrix (``LLAMA_ATTN_ROT_DISABLE=1`` turns it off) and the state does not say so: ``llama_rotation`` tells
the import, which records it as the spec's ``"hadamard-llama"`` rotation, so attention over the imported
cache is right and a snapshot never restores into a cache of the other rotation.

Nothing here imports llama.cpp or gguf (``model_info`` reads a GGUF header itself).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import formats, validate
from ..backend import Backend
from ..errors import (
    LlamaStateCorruptError,
    LlamaStateError,
    LlamaStateMismatchError,
    LlamaStateUnsupportedError,
    LlamaStateVersionError,
    SpecError,
)
from ..fingerprint import Fingerprint
from ..spec import CacheSpec
from .gguf_header import gguf_metadata, model_info

__all__ = [
    "LlamaStateCorruptError",
    "LlamaStateError",
    "LlamaStateMismatchError",
    "LlamaStateUnsupportedError",
    "LlamaStateVersionError",
    "FILE_MAGIC",
    "FILE_VERSION",
    "IO_MAGIC",
    "LayerRows",
    "LlamaSeqState",
    "Section",
    "check_model",
    "export_state",
    "gguf_metadata",
    "import_into",
    "import_state",
    "model_info",
    "read_bytes",
    "read_file",
    "spec_for",
]

IO_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic: the head of llama_state_seq_get_data's bytes
FILE_MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, 'ggsq'
FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
# ggml_type ids of the formats kvhal and ggml share (ggml.h)
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}
GGML_IDS = {name: i for i, name in GGML_TYPES.items()}
PLAIN = ("f32", "f16", "bf16")  # not quantized: llama.cpp never rotates them, and V may be transposed
MAX_COUNT = 1 << 20  # streams, layers: a larger count is a corrupt header, not a model


@dataclass(frozen=True)
class LayerRows:
    """One layer's rows, one token per row in position order: uint8 ``[n, row_bytes]`` each."""

    k_format: str
    v_format: str
    k: np.ndarray
    v: np.ndarray


@dataclass(frozen=True)
class Section:
    """One KV cache's part of the state (two for a sliding-window model)."""

    layers: tuple[LayerRows, ...]
    v_trans: bool  # V written transposed (llama.cpp without flash attention)
    n_stream: int = 1
    stream: int = 0  # the stream that held the sequence's cells
    seq_id: int = 0  # the seq id written with every cell


@dataclass(frozen=True)
class LlamaSeqState:
    """A parsed llama.cpp sequence state: its sections, its token count, the token ids a file carries."""

    sections: tuple[Section, ...]
    n_tokens: int
    tokens: tuple[int, ...] | None = None
    seq_id: int = 0  # the source seq id in get_data's header

    @property
    def n_layers(self) -> int:
        return sum(len(s.layers) for s in self.sections)

    def to_bytes(self, seq_id: int | None = None) -> bytes:
        """What ``llama_state_seq_get_data`` returns for this state (``llama_state_seq_set_data`` reads it)."""
        sid = _int(self.seq_id if seq_id is None else seq_id, "seq_id", -(2**31), 2**31)
        return struct.pack("<Ii", IO_MAGIC, sid) + b"".join(_write_section(s) for s in self.sections)

    def to_file_bytes(self) -> bytes:
        """What ``llama_state_seq_save_file`` writes for this state (``llama_state_seq_load_file`` reads it)."""
        tokens = validate.token_ids(list(self.tokens or ()))  # an i32 each: not refused by numpy's cast below
        if tokens and len(tokens) != self.n_tokens:
            raise LlamaStateMismatchError(f"{len(tokens)} token ids for a state of {self.n_tokens} tokens")
        head = struct.pack("<III", FILE_MAGIC, FILE_VERSION, len(tokens)) + np.asarray(tokens, "<i4").tobytes()
        return head + b"".join(_write_section(s) for s in self.sections)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state as a sequence-state file (``.ggsq``). A path that cannot be written (a directory, a
        missing directory, no permission) is a ``LlamaStateError``."""
        target = Path(_path(path))
        data = self.to_file_bytes()
        try:
            target.write_bytes(data)
        except OSError as e:
            raise LlamaStateError(f"cannot write {str(target)!r}: {e.strerror or e}") from None


def _int(x: Any, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """An int; with ``lo``/``hi``, within ``[lo, hi)`` (the state's i32/u32 fields: struct.pack cannot write more)."""
    if not validate.is_int(x):
        raise SpecError(f"{what} must be an int, got {type(x).__name__}")
    if lo is not None and hi is not None and not lo <= x < hi:
        raise SpecError(f"{what} must be in [{lo}, {hi}) (a llama.cpp state field), got {x}")
    return int(x)


def _state(state: Any) -> LlamaSeqState:
    if not isinstance(state, LlamaSeqState):
        raise SpecError(f"state must be a LlamaSeqState (read_bytes/read_file), got {type(state).__name__}")
    return state


def _path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise SpecError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _data(data: Any, what: str) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SpecError(f"{what} must be bytes (what llama_state_seq_get_data returns), got {type(data).__name__}")
    view = memoryview(data)
    return (view if view.c_contiguous else memoryview(view.tobytes())).cast("B")  # cast takes contiguous views only


# -- reading -------------------------------------------------------------------------------------------


class _Cursor:
    def __init__(self, data: memoryview, what: str) -> None:
        self.data, self.at, self.what = data, 0, what

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.left:
            raise LlamaStateCorruptError(
                f"{self.what} ends at byte {len(self.data)} but needs {n} more at byte {self.at}: it is truncated "
                "or not a llama.cpp sequence state; save it again"
            )
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def count(self, what: str, limit: int = MAX_COUNT) -> int:
        n = self.u32()
        if n > limit:
            raise LlamaStateCorruptError(f"{self.what}: {what} {n} at byte {self.at - 4} is not plausible (corrupt)")
        return n


def _fmt(type_id: int, what: str, c: _Cursor) -> formats.Format:
    name = GGML_TYPES.get(type_id)
    if name is None:
        raise LlamaStateUnsupportedError(
            f"{c.what}: {what} has ggml type {type_id}, which kvhal does not share with llama.cpp (it moves "
            f"{sorted(GGML_IDS)}); run llama.cpp with one of those cache types"
        )
    return formats.get(name)


def _rows(c: _Cursor, n: int, row_bytes: int, fmt: formats.Format, what: str) -> np.ndarray:
    if row_bytes == 0 or row_bytes % fmt.block_bytes:
        raise LlamaStateCorruptError(f"{c.what}: {what} rows of {row_bytes} bytes are not whole {fmt.name} blocks")
    if n * row_bytes > c.left:
        c.take(n * row_bytes)  # raises: truncated
    return np.frombuffer(c.take(n * row_bytes), np.uint8).reshape(n, row_bytes)


def _read_section(c: _Cursor) -> tuple[Section, np.ndarray]:
    n_stream = c.count("stream count", 4096)
    if n_stream == 0:
        raise LlamaStateCorruptError(f"{c.what}: a KV cache section with 0 streams (corrupt)")
    found: tuple[Section, np.ndarray] | None = None
    for s in range(n_stream):
        n = c.count("cell count")
        if n == 0:
            continue
        if found is not None:
            raise LlamaStateUnsupportedError(
                f"{c.what}: cells in more than one stream; kvhal imports one sequence (llama_state_seq_get_data)"
            )
        if n * 12 > c.left:
            c.take(n * 12)
        meta = np.frombuffer(c.take(n * 12), "<i4").reshape(n, 3)
        if (meta[:, 1] != 1).any():
            raise LlamaStateUnsupportedError(
                f"{c.what}: cells with {int(meta[meta[:, 1] != 1][0, 1])} sequence ids (or per-cell extension data, "
                "as M-RoPE and n-gram models write); kvhal imports a single sequence's state of a text model"
            )
        seq_ids = meta[:, 2]
        if (seq_ids != seq_ids[0]).any() or seq_ids[0] < 0:
            raise LlamaStateCorruptError(f"{c.what}: cells of different sequence ids in a sequence state (corrupt)")
        v_trans = c.u32()
        if v_trans > 1:
            raise LlamaStateCorruptError(f"{c.what}: v_trans is {v_trans}, not 0 or 1 (corrupt)")
        n_layer = c.count("layer count", 65536)
        ks: list[tuple[formats.Format, np.ndarray]] = []
        for il in range(n_layer):
            fmt = _fmt(c.i32(), f"layer {il}'s K", c)
            ks.append((fmt, _rows(c, n, c.u64(), fmt, f"layer {il}'s K")))
        vs: list[tuple[formats.Format, np.ndarray]] = []
        for il in range(n_layer):
            fmt = _fmt(c.i32(), f"layer {il}'s V", c)
            if not v_trans:
                vs.append((fmt, _rows(c, n, c.u64(), fmt, f"layer {il}'s V")))
                continue
            el, n_embd = c.u32(), c.u32()
            if fmt.name not in PLAIN:
                raise LlamaStateUnsupportedError(
                    f"{c.what}: transposed V of type {fmt.name}; llama.cpp writes it for f32/f16/bf16 only"
                )
            if el != fmt.block_bytes or n_embd == 0:
                raise LlamaStateCorruptError(
                    f"{c.what}: layer {il}'s transposed V has {el}-byte elements of {fmt.name} (corrupt)"
                )
            raw = _rows(c, n_embd, n * el, fmt, f"layer {il}'s V")
            vs.append(
                (fmt, np.ascontiguousarray(raw.reshape(n_embd, n, el).transpose(1, 0, 2).reshape(n, n_embd * el)))
            )
        layers = tuple(LayerRows(kf.name, vf.name, k, v) for (kf, k), (vf, v) in zip(ks, vs))
        found = Section(layers, bool(v_trans), n_stream, s, int(seq_ids[0])), meta[:, 0].copy()
    if found is None:
        return Section((), False, n_stream), np.zeros(0, np.int32)
    return found


def _order(sec: Section, pos: np.ndarray, what: str, index: int) -> Section:
    """The section's rows in position order; positions must be 0..n-1."""
    order = np.argsort(pos, kind="stable")
    if not np.array_equal(pos[order], np.arange(len(pos))):
        lo = int(pos.min()) if len(pos) else 0
        why = " (a sliding-window section keeps only the window's cells)" if index > 0 or lo > 0 else ""
        raise LlamaStateUnsupportedError(
            f"{what}: its {len(pos)} cells hold positions {lo}..{int(pos.max()) if len(pos) else 0}, not every position "
            f"from 0{why}; kvhal sequences are dense from position 0: save the state of a whole sequence"
        )
    if np.array_equal(order, np.arange(len(pos))):
        return sec
    layers = tuple(LayerRows(x.k_format, x.v_format, x.k[order], x.v[order]) for x in sec.layers)
    return Section(layers, sec.v_trans, sec.n_stream, sec.stream, sec.seq_id)


def _read_sections(c: _Cursor) -> tuple[tuple[Section, ...], int]:
    sections: list[Section] = []
    n_tokens = -1
    while c.left and len(sections) < 2:
        sec, pos = _read_section(c)
        sec = _order(sec, pos, c.what, len(sections))
        if n_tokens >= 0 and len(pos) != n_tokens:
            raise LlamaStateUnsupportedError(
                f"{c.what}: its sections hold {n_tokens} and {len(pos)} tokens; kvhal needs every layer's tokens"
            )
        n_tokens = len(pos)
        sections.append(sec)
    if not sections:
        raise LlamaStateCorruptError(f"{c.what}: no KV cache state after the header (truncated)")
    if c.left:
        raise LlamaStateCorruptError(f"{c.what}: {c.left} bytes left over after the state (corrupt, or not a state)")
    return tuple(sections), n_tokens


def read_bytes(data: bytes | bytearray | memoryview) -> LlamaSeqState:
    """Parse what ``llama_state_seq_get_data`` returned. Raises a ``LlamaStateError`` subclass."""
    c = _Cursor(_data(data, "data"), "llama.cpp sequence state")
    magic = c.u32()
    if magic != IO_MAGIC:
        raise LlamaStateCorruptError(
            f"not a llama.cpp sequence state: it starts with {magic:#010x}, not {IO_MAGIC:#010x} (a .ggsq file is "
            "read by read_file)"
        )
    seq_id = c.i32()
    sections, n = _read_sections(c)
    return LlamaSeqState(sections, n, None, seq_id)


def read_file(path: str | os.PathLike[str] | bytes | bytearray | memoryview) -> LlamaSeqState:
    """Parse a ``llama_state_seq_save_file`` file (or its bytes), token ids included."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        data, what = _data(path, "path"), "llama.cpp sequence-state file"
    else:
        p = _path(path)
        try:
            data, what = memoryview(Path(p).read_bytes()), f"llama.cpp sequence-state file {p!r}"
        except OSError as e:
            raise LlamaStateCorruptError(f"cannot read {p!r}: {e}") from None
    c = _Cursor(data, what)
    magic, version = c.u32(), c.u32()
    if magic != FILE_MAGIC:
        raise LlamaStateCorruptError(f"{what}: magic {magic:#010x} is not 'ggsq' ({FILE_MAGIC:#010x})")
    if version != FILE_VERSION:
        raise LlamaStateVersionError(
            f"{what}: sequence-state version {version}; kvhal reads version {FILE_VERSION} (llama.cpp's "
            "LLAMA_STATE_SEQ_VERSION since 2024): save it again with a current llama.cpp"
        )
    n_tok = c.count("token count", c.left // 4)
    tokens = tuple(int(t) for t in np.frombuffer(c.take(4 * n_tok), "<i4"))
    sections, n = _read_sections(c)
    if tokens and len(tokens) != n:
        raise LlamaStateMismatchError(f"{what}: {len(tokens)} token ids for {n} cached tokens")
    if any(t < 0 for t in tokens):
        raise LlamaStateCorruptError(f"{what}: negative token ids (corrupt)")
    return LlamaSeqState(sections, n, tokens, 0)


# -- writing -------------------------------------------------------------------------------------------


def _check_section(sec: Section) -> int:
    """A Section's fields and rows as the state writes them (one built by hand, too): its i32/u32 fields in range and
    rows llama.cpp reads back, refused here rather than by struct.pack or a dict lookup; returns its token count."""
    if not isinstance(sec, Section):
        raise SpecError(f"a state's sections are Section objects, got {type(sec).__name__}")
    n_stream = _int(sec.n_stream, "Section.n_stream", 1, 2**32)
    _int(sec.stream, "Section.stream", 0, n_stream)
    _int(sec.seq_id, "Section.seq_id", 0, 2**31)
    v_trans = validate.check_bool(sec.v_trans, "Section.v_trans", SpecError)  # a u32 llama.cpp compares with 0/1
    if not isinstance(sec.layers, (tuple, list)):
        raise SpecError(f"a Section's layers are a tuple of LayerRows, got {type(sec.layers).__name__}")
    first = sec.layers[0].k if sec.layers and isinstance(sec.layers[0], LayerRows) else None
    n = len(first) if isinstance(first, np.ndarray) and first.ndim else 0  # (other rows are refused below)
    for x in sec.layers:
        if not isinstance(x, LayerRows):
            raise SpecError(f"a Section's layers are LayerRows objects, got {type(x).__name__}")
        for w, name, rows in (("K", x.k_format, x.k), ("V", x.v_format, x.v)):
            if not isinstance(name, str) or name not in GGML_IDS:
                raise LlamaStateUnsupportedError(
                    f"{w} format {name!r} is not a ggml type llama.cpp reads ({sorted(GGML_IDS)})"
                )
            fmt = formats.get(name)
            if not (isinstance(rows, np.ndarray) and rows.dtype == np.uint8 and rows.ndim == 2 and len(rows) == n):
                raise SpecError(
                    f"a layer's {w} rows are uint8 [{n}, row bytes] (one row per token), got {type(rows).__name__} {getattr(rows, 'shape', '')}"
                )
            if n and (rows.shape[1] == 0 or rows.shape[1] % fmt.block_bytes):
                raise SpecError(f"a layer's {w} rows of {rows.shape[1]} bytes are not whole {name} blocks")
        if v_trans and x.v_format not in PLAIN:
            raise LlamaStateUnsupportedError(f"llama.cpp transposes V of f32/f16/bf16 only, not {x.v_format}")
    return n


def _write_section(sec: Section) -> bytes:
    n = _check_section(sec)
    out = [struct.pack("<I", sec.n_stream)]
    for s in range(sec.n_stream):
        if s != sec.stream or n == 0:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", n))
        meta = np.empty((n, 3), "<i4")
        meta[:, 0], meta[:, 1], meta[:, 2] = np.arange(n), 1, sec.seq_id
        out.append(meta.tobytes())
        out.append(struct.pack("<II", int(sec.v_trans), len(sec.layers)))
        for x in sec.layers:
            out += [struct.pack("<iQ", GGML_IDS[x.k_format], x.k.shape[1]), np.ascontiguousarray(x.k).tobytes()]
        for x in sec.layers:
            if not sec.v_trans:
                out += [struct.pack("<iQ", GGML_IDS[x.v_format], x.v.shape[1]), np.ascontiguousarray(x.v).tobytes()]
                continue
            el = formats.get(x.v_format).block_bytes
            n_embd = x.v.shape[1] // el
            out.append(struct.pack("<iII", GGML_IDS[x.v_format], el, n_embd))
            out.append(np.ascontiguousarray(x.v.reshape(n, n_embd, el).transpose(1, 0, 2)).tobytes())
    return b"".join(out)


# -- kvhal caches ----------------------------------------------------------------------------------------


def _layer_formats(state: LlamaSeqState) -> tuple[str, str, int, int]:
    layers = [x for s in state.sections for x in s.layers]
    if not layers:
        raise LlamaStateUnsupportedError("the state holds no layers (an empty sequence); nothing to import")
    kinds = {(x.k_format, x.v_format, x.k.shape[1], x.v.shape[1]) for x in layers}
    if len(kinds) != 1:
        raise LlamaStateUnsupportedError(
            f"layers of different types or widths {sorted(kinds)}; a kvhal cache has one K and one V format and head "
            "size for all layers"
        )
    return kinds.pop()


def spec_for(state: LlamaSeqState, *, kv_heads: int, llama_rotation: bool | None, block_size: int = 16) -> CacheSpec:
    """The kvhal spec that holds ``state``'s bytes unchanged: its formats, ``kv_heads`` KV heads, and
    ``"hadamard-llama"`` on a quantized side when ``llama_rotation`` (llama.cpp rotates quantized K/V unless
    ``LLAMA_ATTN_ROT_DISABLE=1``; the state does not record it, so a quantized state needs True or False)."""
    state = _state(state)
    kv_heads = _int(kv_heads, "kv_heads")
    if kv_heads <= 0:
        raise SpecError(f"kv_heads must be positive, got {kv_heads}")
    if llama_rotation is not None:  # numpy's bool is a bool (validate.check_bool), 1 is not
        llama_rotation = validate.check_bool(llama_rotation, "llama_rotation (True, False or None)", SpecError)
    kf, vf, k_bytes, v_bytes = _layer_formats(state)
    dims = []
    for name, nbytes in ((kf, k_bytes), (vf, v_bytes)):
        fmt = formats.get(name)
        n_embd = nbytes // fmt.block_bytes * fmt.block_len
        if n_embd % kv_heads or (n_embd // kv_heads) % fmt.block_len:
            raise LlamaStateMismatchError(
                f"a {name} row of {n_embd} values does not split into {kv_heads} KV heads of whole {name} blocks; "
                "pass the model's KV head count (--kv-heads, or --model M.gguf)"
            )
        dims.append(n_embd // kv_heads)
    if dims[0] != dims[1]:
        raise LlamaStateUnsupportedError(
            f"K heads of {dims[0]} and V heads of {dims[1]} values; kvhal needs one head_dim"
        )
    head_dim = dims[0]
    quantized = [name not in PLAIN for name in (kf, vf)]
    if any(quantized) and llama_rotation is None:
        raise SpecError(
            "a quantized llama.cpp state does not record whether llama.cpp rotated it: pass llama_rotation=True "
            "(llama.cpp's default) or False (it ran with LLAMA_ATTN_ROT_DISABLE=1); CLI: --llama-rotation on|off"
        )
    rot = ["hadamard-llama" if q and llama_rotation and head_dim % 64 == 0 else None for q in quantized]
    return CacheSpec(
        n_layers=state.n_layers,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        k_format=kf,
        v_format=vf,
        block_size=block_size,
        k_rotation=rot[0],
        v_rotation=rot[1],
    )


def _check_model(state: LlamaSeqState, model: dict[str, Any]) -> None:
    kf, vf, k_bytes, v_bytes = _layer_formats(state)
    if state.n_layers != model["n_layers"]:
        raise LlamaStateMismatchError(
            f"the state has {state.n_layers} layers, model {model['name']!r} has {model['n_layers']}: it is another "
            "model's state"
        )
    for name, nbytes, dim in ((kf, k_bytes, model["head_dim_k"]), (vf, v_bytes, model["head_dim_v"])):
        fmt = formats.get(name)
        if nbytes // fmt.block_bytes * fmt.block_len != model["n_kv_heads"] * dim:
            raise LlamaStateMismatchError(
                f"the state's {name} rows hold {nbytes // fmt.block_bytes * fmt.block_len} values per token, model "
                f"{model['name']!r} stores {model['n_kv_heads']} x {dim}: it is another model's state"
            )


def import_into(cache: Any, state: LlamaSeqState, *, llama_rotation: bool | None, tokens: Any = None) -> int:
    """Add ``state`` to ``cache`` as a new sequence (its bytes unchanged) and return its id. The cache's spec must be
    the one ``spec_for`` gives (same formats, heads, rotation; block size and capacity free). The state's token
    ids (``tokens``, or a file's) become the sequence's, so its full blocks are hashed and matchable. All or
    nothing: a failure frees the new sequence."""
    from ..cache import KVCache

    tokens = None if tokens is None else validate.token_ids(tokens)  # a list of ints or an int array
    if not isinstance(cache, KVCache):
        raise SpecError(f"cache must be a kvhal.KVCache, got {type(cache).__name__}")
    state = _state(state)
    want = spec_for(
        state, kv_heads=cache.spec.n_kv_heads, llama_rotation=llama_rotation, block_size=cache.spec.block_size
    )
    have = cache.resolved_spec
    if have != want:
        raise LlamaStateMismatchError(
            f"the state needs a cache of spec {want}, this cache is {have}; create it with kvhal.interop.llamacpp."
            "spec_for(state, ...) (rotation included: a rotated state in an unrotated cache attends wrongly)"
        )
    ids = list(state.tokens or ()) if tokens is None else tokens
    if ids is not None and len(ids) not in (0, state.n_tokens):
        raise LlamaStateMismatchError(f"{len(ids)} token ids for a state of {state.n_tokens} tokens")
    seq = int(cache.new_seq())
    try:
        layer = 0
        for sec in state.sections:
            for x in sec.layers:
                cache.store_rows(seq, layer, x.k, x.v)
                layer += 1
        if ids:
            cache.append_tokens(seq, ids)
    except BaseException:
        cache.free_seq(seq)
        raise
    return seq


def import_state(
    state: LlamaSeqState | bytes | bytearray | memoryview,
    *,
    kv_heads: int,
    llama_rotation: bool | None,
    backend: str | Backend = "auto",
    block_size: int = 16,
    capacity_tokens: int | None = None,
    model: str = "",
    tokens: Any = None,
) -> tuple[Any, int]:
    """A new ``KVCache`` holding ``state`` (parsed, or get_data's bytes) byte for byte, and its sequence id.

    ``kv_heads``: the model's KV heads (``model_info(gguf)["n_kv_heads"]``); ``llama_rotation``: whether llama.cpp
    rotated quantized K/V (its default; False under ``LLAMA_ATTN_ROT_DISABLE=1``), required for a quantized
    state; ``model``: the fingerprint's model name (a snapshot of the cache names it)."""
    from ..cache import KVCache

    tokens = None if tokens is None else validate.token_ids(tokens)  # before a cache is made
    if not isinstance(state, LlamaSeqState):
        state = read_bytes(state)
    if not isinstance(model, str):
        raise SpecError(f"model must be a str, got {type(model).__name__}")
    spec = spec_for(state, kv_heads=kv_heads, llama_rotation=llama_rotation, block_size=block_size)
    sections = [len(s.layers) for s in state.sections]
    extra = {"llama.cpp sections": sections} if len(sections) > 1 else {}
    cap = max(1, state.n_tokens) if capacity_tokens is None else capacity_tokens
    cache = KVCache(spec, cap, backend, fingerprint=Fingerprint(model=model, extra=extra))
    return cache, import_into(cache, state, llama_rotation=llama_rotation, tokens=tokens)


def export_state(
    cache: Any, seq: int, *, v_trans: bool = False, seq_id: int = 0, n_stream: int = 1, stream: int = 0
) -> LlamaSeqState:
    """``seq`` of ``cache`` as a llama.cpp sequence state (its bytes unchanged; ``.to_bytes()`` for
    ``llama_state_seq_set_data``, ``.save(path)`` for ``llama_state_seq_load_file``).

    ``v_trans``: write V transposed, as llama.cpp holds it without flash attention (f32/f16/bf16 only);
    ``n_stream``: the target context's streams (1 unless it runs ``kv_unified=False`` with several sequences).
    The cache's formats must be ggml's, without scales or tail; a quantized side rotated ``"hadamard-llama"``
    is what llama.cpp stores by default, an unrotated one is read right only under ``LLAMA_ATTN_ROT_DISABLE=1``.
    A sliding-window model's layers (imported in two sections) are written back in the same two sections."""
    from ..cache import KVCache

    if not isinstance(cache, KVCache):
        raise SpecError(f"cache must be a kvhal.KVCache, got {type(cache).__name__}")
    v_trans = validate.check_bool(v_trans, "v_trans", SpecError)
    # an i32 and a u32 in the state: refused here, not by struct.pack at to_bytes()
    seq_id, n_stream = _int(seq_id, "seq_id", 0, 2**31), _int(n_stream, "n_stream", 1, 2**32)
    stream = _int(stream, "stream")
    if not 0 <= stream < n_stream:
        raise SpecError(f"need 0 <= stream < n_stream, got stream {stream}, n_stream {n_stream}")
    spec = cache.resolved_spec
    for w in "kv":
        name, rot = getattr(spec, f"{w}_format"), getattr(spec, f"{w}_rotation")
        if name not in GGML_IDS:
            raise LlamaStateUnsupportedError(
                f"{w}_format {name!r} is not a ggml type llama.cpp reads; use one of {sorted(GGML_IDS)}"
            )
        if getattr(spec, f"{w}_scale") is not None:
            raise LlamaStateUnsupportedError(
                f"{w}_scale={getattr(spec, f'{w}_scale')!r}: llama.cpp's cache has no scales"
            )
        if rot is not None and (rot != "hadamard-llama" or name in PLAIN):
            raise LlamaStateUnsupportedError(
                f"{w}_rotation={rot!r} on {name}: llama.cpp rotates quantized K/V with 'hadamard-llama' only"
            )
    if spec.uses_tail:
        raise LlamaStateUnsupportedError("a cache with an f16 tail holds rows llama.cpp has no bytes for; use tail=0")
    if v_trans and spec.v_format not in PLAIN:
        raise LlamaStateUnsupportedError(f"llama.cpp transposes V of f32/f16/bf16 only, not {spec.v_format}")
    lens = {cache.seq_len(seq, layer) for layer in range(spec.n_layers)}
    if len(lens) != 1:
        raise LlamaStateUnsupportedError(
            f"sequence {seq} has layers of different lengths {sorted(lens)}; store every layer"
        )
    n = lens.pop()
    split = cache.fingerprint.extra.get("llama.cpp sections", [spec.n_layers])
    if not (isinstance(split, list) and all(isinstance(x, int) for x in split) and sum(split) == spec.n_layers):
        raise LlamaStateUnsupportedError(f"the fingerprint's llama.cpp sections {split!r} do not add up to the layers")
    rows = []
    for layer in range(spec.n_layers):
        k, v = cache.load_rows(seq, layer)
        # the widths spelled out: an empty sequence (n 0) has no -1 to infer; it writes llama.cpp's 0-cell state
        k, v = (x.reshape(n, x.shape[1] * x.shape[2]) for x in (k, v))
        rows.append(LayerRows(spec.k_format, spec.v_format, k, v))
    sections, at = [], 0
    for count in split:
        sections.append(Section(tuple(rows[at : at + count]), v_trans, n_stream, stream, seq_id))
        at += count
    tokens = cache.tokens(seq)
    return LlamaSeqState(tuple(sections), n, tuple(tokens) if len(tokens) == n else None, seq_id)


def check_model(state: LlamaSeqState, model: dict[str, Any]) -> None:
    """Raise ``LlamaStateMismatchError`` unless ``state`` has ``model``'s layers and K/V widths (``model_info``)."""
    state = _state(state)
    if not isinstance(model, dict):
        raise SpecError(f"model must be the dict model_info returns, got {type(model).__name__}")
    for key in ("n_layers", "n_kv_heads", "head_dim_k", "head_dim_v"):
        if key in model and not validate.is_int(model[key]):
            raise SpecError(f"model[{key!r}] must be an int (as model_info returns), got {model[key]!r}")
    try:
        _check_model(state, model)
    except KeyError as e:
        raise SpecError(f"model must be what model_info returns; it lacks {e}") from None
