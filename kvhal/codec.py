"""The cache's value transforms: per-layer, per-head scales (given or calibrated on a layer's first store)
and the spec's rotation, forward for what is stored and backward for what is read.

A cache stores ``R (x / s)`` and attends with ``s * R q`` against K (exact: ``R`` is orthogonal, ``s`` one
number per KV head), then maps the output back with ``s * R^T out`` for V; every backend gets the
transforms without kernel changes. The per-head step runs through ``Backend.transform_heads``: on the
host (float64 numpy) unless a backend runs it on its device (its ``fused`` ops name "transform").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import formats, transforms
from .backend import Backend
from .errors import ShapeError, UnsupportedError
from .formats import kltq
from .spec import CacheSpec

# a "calibrate" scale of a per-value format (fp8) is searched over this many fractions of a power of two,
# on at most this many values per head of the layer's first store (strided tokens)
CALIBRATION_STEPS = 16
CALIBRATION_VALUES = 16384

# what a store calibrated, kept only if the store succeeds: scales ("k"/"v", layer) -> per-head scales, and
# ("side", layer) -> a kltq K format's one-layer side data
Pending = dict[tuple[str, int], Any]


class Codec:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        # per layer, per-head scales; None while "calibrate" waits for that layer's first store
        self._scales: dict[str, list[np.ndarray | None]] = {
            w: resolve_scale(getattr(spec, f"{w}_scale"), spec) for w in "kv"
        }
        # a kltq K format's side data, one single-layer kltq.Side per layer (None until its first store); the
        # cache hands this list to its pools (``Pools.side``), so a backend reads ``side[layer]``
        self._query_side: dict[int, tuple[kltq.Side, np.ndarray, np.ndarray]] = {}
        self.sides: list[kltq.Side | None] = (
            [kltq.layer_side(spec.k_side, i) for i in range(spec.n_layers)]
            if spec.k_side is not None
            else [None] * spec.n_layers
        )

    # -- scales --------------------------------------------------------------------------------------

    @property
    def resolved_spec(self) -> CacheSpec:
        """The spec with calibrated scales filled in (once the first store fixed them): what names the
        cache's bytes in fingerprints, block hashes and snapshots."""
        spec, out = self.spec, dict[str, Any]()
        for w in "kv":
            per_layer = self._scales[w]
            if getattr(spec, f"{w}_scale") == "calibrate" and all(sc is not None for sc in per_layer):
                out[f"{w}_scale"] = tuple(tuple(float(x) for x in sc) for sc in per_layer if sc is not None)
        if spec.k_codec and spec.k_side is None and all(x is not None for x in self.sides):
            out["k_side"] = kltq.join_layers([x for x in self.sides if x is not None])
        return dataclasses.replace(spec, **out) if out else spec

    def calibrating(self) -> bool:
        """True while a "calibrate" scale (or kltq side data) is fixed for some layers but not yet for all."""
        return any(
            any(sc is None for sc in per_layer) and any(sc is not None for sc in per_layer)
            for per_layer in [*self._scales.values(), list[Any](self.sides)]
        )

    def uncalibrated(self, which: str) -> bool:
        """True when ``which`` ("k"/"v") is a "calibrate" scale no store has fixed yet, in any layer."""
        return all(sc is None for sc in self._scales[which])

    def scales(self) -> dict[str, tuple[tuple[float, ...] | None, ...]]:
        return {
            w: tuple(None if sc is None else tuple(float(y) for y in sc) for sc in per_layer)
            for w, per_layer in self._scales.items()
        }

    def scale(self, which: str, layer: int) -> np.ndarray:
        """Layer ``layer``'s per-head scales (1.0 for a "calibrate" layer that holds nothing yet)."""
        sc = self._scales[which][layer]
        return np.ones(self.spec.n_kv_heads) if sc is None else sc

    def commit(self, pending: Pending) -> bool:
        """Keep the scales a successful store calibrated; True when any changed (the cache's root hash then
        changes too)."""
        for (w, layer), sc in pending.items():
            if w == "side":
                self.sides[layer] = sc
            else:
                self._scales[w][layer] = sc
        return bool(pending)

    @contextmanager
    def staging(self, pending: Pending) -> Iterator[None]:
        """The side data a store calibrated, in place while its rows are written (a backend's store reads it);
        taken back should the store fail (``commit`` keeps it when it succeeds)."""
        layers = [layer for (w, layer) in pending if w == "side"]
        for layer in layers:
            self.sides[layer] = pending[("side", layer)]
        try:
            yield
        except BaseException:
            for layer in layers:
                self.sides[layer] = None
            raise

    def adopt_side(self, side: kltq.Side) -> None:
        """Take every layer's kltq side data at once (a restore into a cache that had not stored yet)."""
        self.sides[:] = [kltq.layer_side(side, i) for i in range(self.spec.n_layers)]

    def adopt(self, per_layer: dict[str, list[np.ndarray | None]]) -> None:
        """Take every layer's scales at once (a restore into a "calibrate" cache that had not stored yet)."""
        self._scales.update(per_layer)

    def calibrate(self, which: str, x: np.ndarray) -> np.ndarray:
        """Per-head scales from a layer's first store ``x [n, H, D]`` (rotated first where the spec rotates).

        The power of two that brings the largest ``|x|`` to at most the format's calibration_max; a
        per-value format (fp8) then multiplies it by whichever of CALIBRATION_STEPS fractions
        ``2**(i/steps)`` reads the store back with the least squared error. Dividing by a power of
        two is exact in a float format, so it only moves values out of saturation and subnormals;
        the fraction moves where every value falls between the format's steps (SmolLM2's keys in
        fp8_e4m3: 10% lower attention KL than scale 1; vLLM's ``amax / 448`` was 3% higher).
        """
        fmt = self.spec.k_fmt if which == "k" else self.spec.v_fmt
        if fmt.calibration_max is None:
            return np.ones(self.spec.n_kv_heads)
        if (mode := getattr(self.spec, f"{which}_rotation")) is not None:
            x = transforms.rotate(x, mode, which)
        x = np.asarray(x, np.float64)
        amax = np.abs(x).max(axis=(0, 2))
        ratio = np.where(amax > 0, amax, fmt.calibration_max) / fmt.calibration_max
        base = np.exp2(np.ceil(np.log2(ratio)))
        if fmt.round_values is None:
            return base
        n, n_heads, d = x.shape
        sample = x[:: max(1, n * d // CALIBRATION_VALUES)].transpose(1, 0, 2).reshape(n_heads, -1)
        scales = base[:, None] * np.exp2(np.arange(CALIBRATION_STEPS) / CALIBRATION_STEPS)[None, :]
        err = np.stack(
            [
                ((fmt.round_values((sample / sc[:, None]).astype(np.float32)) * sc[:, None] - sample) ** 2).sum(1)
                for sc in scales.T
            ],
            axis=1,
        )  # [H, steps]
        return scales[np.arange(n_heads), err.argmin(axis=1)]

    # -- values --------------------------------------------------------------------------------------

    def encode(self, backend: Backend, layer: int, k: Any, v: Any) -> tuple[np.ndarray, np.ndarray, Pending]:
        """A store's host f32 rows in stored form (scaled and rotated where the spec says; as given for a tail
        without transforms), plus the scales this store calibrated. Checks values before any calibration."""
        f32 = formats.get("f32")
        out, pending = [], Pending()
        for w, x in (("k", k), ("v", v)):
            x = np.asarray(backend.to_numpy(x), np.float32)
            f32.check_values(x)  # NaN/inf never reach a calibration
            sc = self._scales[w][layer]
            if sc is None:
                sc = pending[(w, layer)] = self.calibrate(w, x)
            out.append(self.forward(w, x, sc) if self.spec.transformed else x)
        if self.spec.k_codec and self.sides[layer] is None:
            pending[("side", layer)] = self.calibrate_side(out[0])
        return out[0], out[1], pending

    def calibrate_side(self, k: np.ndarray) -> kltq.Side:
        """A kltq K format's side data for one layer from its first store ``k [n, H, D]`` (plain KLT; the
        spec's sink tokens skipped, as they are attended in f16)."""
        skip = self.spec.sink_tokens
        if len(k) - skip < 2:
            raise ShapeError(
                f"{self.spec.k_format} calibrates each layer on its first store, which needs at least {skip + 2} "
                f"tokens ({skip} sink tokens + 2); this one has {len(k)}: store the prefill first, or give the "
                "side data (CacheSpec(k_side=...), written by kvhal eval --calibrate)"
            )
        return kltq.calibrate([k], kltq.parse_name(self.spec.k_format), skip=skip)

    def forward(self, which: str, x: np.ndarray, sc: np.ndarray) -> np.ndarray:
        """What is stored for values ``x [n, H, D]``: ``R (x / scale)``, f32."""
        y = np.asarray(x, np.float64) / sc[None, :, None]
        if (mode := getattr(self.spec, f"{which}_rotation")) is not None:
            y = transforms.rotate(y, mode, which)
        return y.astype(np.float32)

    def backward(self, which: str, layer: int, y: np.ndarray) -> np.ndarray:
        """Values from stored form ``y [n, H, D]``: ``scale * R^T y``, f32."""
        x = np.asarray(y, np.float64)
        if (mode := getattr(self.spec, f"{which}_rotation")) is not None:
            x = transforms.unrotate(x, mode, which)
        return (x * self.scale(which, layer)[None, :, None]).astype(np.float32)

    def query(self, backend: Backend, layer: int, q: Any) -> Any:
        """Queries against stored K ``R (k / s)``: ``s * R q`` per KV head, so scores are unchanged."""
        return self._heads(backend, layer, "k", q)

    def side(self, layer: int) -> kltq.Side:
        """Layer ``layer``'s kltq side data; UnsupportedError before its first store fixed it."""
        side = self.sides[layer]
        if side is None:
            raise UnsupportedError(
                f"layer {layer} of this {self.spec.k_format} cache has no side data yet (it calibrates on its first "
                "store): store to it first"
            )
        return side

    def coefficient_query(self, backend: Backend, layer: int, q: Any) -> tuple[Any, np.ndarray]:
        """Queries in a kltq K format's coefficient space, ``S^T q`` per KV head (what a backend scores against
        the decoded coefficients), and ``q . mu`` per query row and head (float64 ``[n, Hq]``): the score term
        the coefficients leave out, the same for every key (it matters only where scores are merged across
        parts by log-sum-exp)."""
        side = self.side(layer)
        if self._query_side.get(layer, (None,))[0] is not side:  # float64 S and mu, once per layer's side data
            self._query_side[layer] = (side, side.synthesis[0].astype(np.float64), side.mean[0].astype(np.float64))
        _, synthesis, mean = self._query_side[layer]
        qh = np.asarray(backend.to_numpy(q), np.float64)
        n, n_heads, d = qh.shape
        grouped = qh.reshape(n, self.spec.n_kv_heads, n_heads // self.spec.n_kv_heads, d)  # [n, H, G, D]
        offset = (grouped * mean[None, :, None, :]).sum(-1).reshape(n, n_heads)
        q_c = (grouped @ synthesis[None]).reshape(n, n_heads, d)  # S^T q per head: kltq.query, as one matmul
        return backend.asarray(q_c.astype(np.float32), "q"), offset

    def output(self, backend: Backend, layer: int, out: Any) -> Any:
        """Attention over stored V ``R (v / s)`` back to values: ``s * R^T out`` per KV head (exact)."""
        return self._heads(backend, layer, "v", out)

    def _heads(self, backend: Backend, layer: int, which: str, x: Any) -> Any:
        rotation = getattr(self.spec, f"{which}_rotation")
        return backend.transform_heads(x, self.scale(which, layer), rotation, inverse=which == "v")


def resolve_scale(value: Any, spec: CacheSpec) -> list[np.ndarray | None]:
    """A spec scale as per-layer, per-head float64 scales; None for a "calibrate" layer (fixed by its first
    store)."""
    if value == "calibrate":
        return [None] * spec.n_layers
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return [np.asarray(x, np.float64) for x in value]
    if value is None:
        per_head = np.ones(spec.n_kv_heads)
    elif isinstance(value, tuple):
        per_head = np.asarray(value, np.float64)
    else:
        per_head = np.full(spec.n_kv_heads, float(value))
    return [per_head.copy() for _ in range(spec.n_layers)]
