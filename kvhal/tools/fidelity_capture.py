"""A model run's attention inputs (``Capture``) and float64 causal attention over them.

``kvhal eval`` (``fidelity``) compares each format against float64 attention over a capture; ``fidelity_model``
takes a capture from a real model and checks it reproduces the model's own attention output. Both import it;
``fidelity_model`` imports nothing of ``fidelity``, so the imports go one way.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ShapeError, SpecError
from ..validate import is_int

# -- the capture -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    """One run's per-layer queries ``[T, n_heads, D]`` and keys/values ``[T, n_kv_heads, D]`` (float32)."""

    q: tuple[np.ndarray, ...]
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    scale: float  # the model's softmax scale
    model: str
    note: str = ""  # how the capture was taken (a causal-masked encoder, quantized weights)
    causal_encoder: bool = False  # an encoder's activations under a causal mask (no decoder was at hand)

    def __post_init__(self) -> None:
        if not (len(self.q) == len(self.k) == len(self.v)) or not self.q:
            raise ShapeError(
                f"a capture needs q, k, v for the same layers (got {len(self.q)}, {len(self.k)}, {len(self.v)})"
            )
        for name, arrays in (("q", self.q), ("k", self.k), ("v", self.v)):
            for i, x in enumerate(arrays):
                if not isinstance(x, np.ndarray) or x.ndim != 3 or 0 in x.shape:
                    raise ShapeError(
                        f"capture {name}[{i}]: expected a float32 array [tokens, heads, head_dim], got "
                        f"{type(x).__name__} of shape {getattr(x, 'shape', '')}"
                    )
        t, h, d = self.q[0].shape
        kvh = self.k[0].shape[1]
        for name, arrays, heads in (("q", self.q, h), ("k", self.k, kvh), ("v", self.v, kvh)):
            for i, x in enumerate(arrays):
                if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape != (t, heads, d):
                    raise ShapeError(
                        f"capture {name}[{i}]: expected float32 [{t}, {heads}, {d}], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
                    )
                if not np.isfinite(x).all():
                    raise ShapeError(f"capture {name}[{i}] holds NaN or inf")
        if kvh == 0 or h % kvh:
            raise ShapeError(f"capture has {h} query heads, not a multiple of its {kvh} KV heads")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise ShapeError(f"capture scale must be a finite number, got {self.scale!r}")

    @property
    def n_layers(self) -> int:
        return len(self.q)

    @property
    def tokens(self) -> int:
        return int(self.q[0].shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.q[0].shape[1])

    @property
    def n_kv_heads(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.q[0].shape[2])

    def save(self, path: str) -> None:
        """An ``.npz`` file ``kvhal eval --capture`` reads back."""
        meta = {"scale": self.scale, "model": self.model, "note": self.note, "causal_encoder": self.causal_encoder}
        arrays: dict[str, Any] = {
            f"{n}{i}": x for n, xs in (("q", self.q), ("k", self.k), ("v", self.v)) for i, x in enumerate(xs)
        }
        arrays["meta"] = np.array(json.dumps(meta))
        try:
            with open(path, "wb") as fh:
                np.savez(fh, **arrays)
        except OSError as e:
            raise SpecError(f"cannot write the capture to {path}: {e}") from None

    @classmethod
    def load(cls, path: str) -> Capture:
        """Read a capture ``save`` wrote; a file that is not one (not a zip, truncated, a ``meta`` or an array
        that is not what ``save`` writes) is a ``SpecError`` naming the file and what is wrong."""
        what = "not a capture written by kvhal eval --save-capture"
        if not os.path.exists(path):
            raise SpecError(f"--capture {path}: no such file (write one with kvhal eval --save-capture)")
        try:
            archive = np.load(path, allow_pickle=False)
            if not hasattr(archive, "files"):  # a .npy: one array
                raise SpecError(f"{path}: {what} (one .npy array, not an .npz archive)")
            with archive as z:
                if "meta" not in z.files:
                    raise SpecError(f"{path}: {what} (no 'meta' entry)")
                meta = json.loads(str(z["meta"]))
                n = sum(1 for key in z.files if key.startswith("q"))
                q, k, v = (tuple(np.asarray(z[f"{c}{i}"]) for i in range(n)) for c in "qkv")
        except SpecError:
            raise
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a torn zip: EOFError too
            why = " ".join(f"{type(e).__name__}: {e}".split())
            raise SpecError(f"{path}: {what} ({why})") from None
        fields = {"scale": ((int, float), "number"), "model": ((str,), "string"), "note": ((str,), "string"),
                  "causal_encoder": ((bool,), "boolean")}  # fmt: skip
        if not isinstance(meta, dict):
            raise SpecError(f"{path}: {what} (its meta is a JSON {type(meta).__name__}, not an object)")
        for key, (types, kind) in fields.items():
            if key not in meta:
                raise SpecError(f"{path}: {what} (its meta has no {key!r})")
            value = meta[key]
            if not isinstance(value, types) or (key == "scale" and isinstance(value, bool)):
                raise SpecError(f"{path}: {what} (its meta's {key!r} is {value!r}, expected a {kind})")
        try:
            return cls(q, k, v, float(meta["scale"]), meta["model"], meta["note"], meta["causal_encoder"])
        except ShapeError as e:
            raise SpecError(f"{path}: {what} ({e})") from None

    def first(self, layers: int | None = None, tokens: int | None = None) -> Capture:
        """The first ``layers`` layers and ``tokens`` tokens."""
        for name, n, have in (("layers", layers, self.n_layers), ("tokens", tokens, self.tokens)):
            if n is not None and (not is_int(n) or n < 1 or n > have):
                raise SpecError(f"{name} must be an int in 1..{have} (the capture has {have}), got {n!r}")
        nl, t = layers or self.n_layers, tokens or self.tokens
        cut = slice(0, t)
        return Capture(
            tuple(np.ascontiguousarray(x[cut]) for x in self.q[:nl]),
            tuple(np.ascontiguousarray(x[cut]) for x in self.k[:nl]),
            tuple(np.ascontiguousarray(x[cut]) for x in self.v[:nl]),
            self.scale,
            self.model,
            self.note,
            self.causal_encoder,
        )


# -- float64 attention ---------------------------------------------------------------------------------


def causal_scores(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Scaled scores ``[n_heads, Tq, S]`` in float64, ``-inf`` where a key is in a query's future.

    ``q [Tq, n_heads, D]`` are the last ``Tq`` of the ``S`` positions of ``k [S, n_kv_heads, D]``; query
    head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``."""
    tq, h, d = q.shape
    s, kvh, _ = k.shape
    g = h // kvh
    qh = np.ascontiguousarray(np.asarray(q, np.float64).transpose(1, 0, 2)).reshape(kvh, g * tq, d)
    kh = np.asarray(k, np.float64).transpose(1, 2, 0)  # [kvh, D, S]
    out = np.matmul(qh, kh).reshape(h, tq, s)
    out *= scale
    future = np.arange(s)[None, :] > (s - tq + np.arange(tq))[:, None]
    out[:, future] = -np.inf
    return out


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities (``-inf`` stays ``-inf``); every row needs one finite score."""
    m = scores.max(axis=-1, keepdims=True)
    z = scores - m
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z


def attention_output(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p [n_heads, Tq, S]`` over ``v [S, n_kv_heads, D]`` -> ``[Tq, n_heads, D]`` float64."""
    h, tq, s = p.shape
    kvh, d = v.shape[1], v.shape[2]
    vh = np.asarray(v, np.float64).transpose(1, 0, 2)  # [kvh, S, D]
    out = np.matmul(p.reshape(kvh, (h // kvh) * tq, s), vh).reshape(h, tq, d)
    return out.transpose(1, 0, 2)


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """``||x - ref|| / ||ref||`` (Frobenius, float64)."""
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))
