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
# ("k_side"/"v_side", layer) -> a kltq K/V format's one-layer side data
Pending = dict[tuple[str, int], Any]


class Codec:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        # per layer, per-head scales; None while "calibrate" waits for that layer's first store
        self._scales: dict[str, list[np.ndarray | None]] = {
            w: resolve_scale(getattr(spec, f"{w}_scale"), spec) for w in "kv"
        }
        # a kltq K (V) format's side data, one single-layer kltq.Side per layer (None until its first store); the
        # cache hands these lists to its pools (``Pools.side``, ``Pools.v_side``), so a backend reads
        # ``side[layer]`` (``v_side[layer]``)
        self._f64: dict[tuple[str, int], tuple[kltq.Side, np.ndarray, np.ndarray]] = {}
        self.sides: list[kltq.Side | None] = self._layers(spec.k_side)
        self.v_sides: list[kltq.Side | None] = self._layers(spec.v_side)

    def _layers(self, side: kltq.Side | None) -> list[kltq.Side | None]:
        n = self.spec.n_layers
        return [None] * n if side is None else [kltq.layer_side(side, i) for i in range(n)]

    def side_list(self, which: str) -> list[kltq.Side | None]:
        """The per-layer side data of K (``which="k"``) or V."""
        return self.sides if which == "k" else self.v_sides

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
        for w in "kv":
            sides = self.side_list(w)
            if getattr(spec, f"{w}_fmt").side_data and getattr(spec, f"{w}_side") is None and None not in sides:
                out[f"{w}_side"] = kltq.join_layers([x for x in sides if x is not None])
        return dataclasses.replace(spec, **out) if out else spec

    def calibrating(self) -> bool:
        """True while a "calibrate" scale (or kltq side data) is fixed for some layers but not yet for all."""
        return any(
            any(sc is None for sc in per_layer) and any(sc is not None for sc in per_layer)
            for per_layer in [*self._scales.values(), list[Any](self.sides), list[Any](self.v_sides)]
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
            if w.endswith("_side"):
                self.side_list(w[0])[layer] = sc
            else:
                self._scales[w][layer] = sc
        return bool(pending)

    @contextmanager
    def staging(self, pending: Pending) -> Iterator[None]:
        """The side data a store calibrated, in place while its rows are written (a backend's store reads it);
        taken back should the store fail (``commit`` keeps it when it succeeds)."""
        staged = [(w[0], layer) for (w, layer) in pending if w.endswith("_side")]
        for w, layer in staged:
            self.side_list(w)[layer] = pending[(f"{w}_side", layer)]
        try:
            yield
        except BaseException:
            for w, layer in staged:
                self.side_list(w)[layer] = None
            raise

    def adopt_side(self, side: kltq.Side, which: str = "k") -> None:
        """Take every layer's kltq side data of K (V) at once (a restore into a cache that had not stored yet)."""
        self.side_list(which)[:] = self._layers(side)

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
        coded = [(w, x) for w, x in zip("kv", out) if getattr(self.spec, f"{w}_fmt").side_data]
        coded = [(w, x) for w, x in coded if self.side_list(w)[layer] is None]
        for w, x in coded:  # both checked before either calibrates (a failed store changes nothing)
            self.check_calibration(w, len(x))
        for w, x in coded:
            pending[(f"{w}_side", layer)] = self.calibrate_side(w, x)
        return out[0], out[1], pending

    def check_calibration(self, which: str, n: int) -> None:
        """ShapeError when a first store of ``n`` tokens is too short to calibrate a kltq K/V format on."""
        skip = self.spec.sink_tokens
        if n - skip < 2:
            fmt = getattr(self.spec, f"{which}_format")
            raise ShapeError(
                f"{fmt} calibrates each layer on its first store, which needs at least {skip + 2} "
                f"tokens ({skip} sink tokens + 2); this one has {n}: store the prefill first, or give the "
                f"side data (CacheSpec({which}_side=...), written by kvhal eval --calibrate)"
            )

    def calibrate_side(self, which: str, x: np.ndarray) -> kltq.Side:
        """A kltq K/V format's side data for one layer from its first store ``x [n, H, D]`` (plain KLT: the
        cache has no queries to weight K by, and queries do not weight V's error; the spec's sink tokens
        skipped, as they are attended in f16)."""
        self.check_calibration(which, len(x))
        fmt = getattr(self.spec, f"{which}_format")
        return kltq.calibrate([x], kltq.parse_name(fmt), skip=self.spec.sink_tokens)

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

    def side(self, layer: int, which: str = "k") -> kltq.Side:
        """Layer ``layer``'s kltq side data of K (V); UnsupportedError before its first store fixed it."""
        side = self.side_list(which)[layer]
        if side is None:
            raise UnsupportedError(
                f"layer {layer} of this {getattr(self.spec, f'{which}_format')} {which.upper()} cache has no side data "
                "yet (it calibrates on its first store): store to it first"
            )
        return side

    def _side_f64(self, layer: int, which: str) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s synthesis ``S [H, D, D]`` and mean ``[H, D]`` of K (V) in float64, once per side data."""
        side = self.side(layer, which)
        if self._f64.get((which, layer), (None,))[0] is not side:
            self._f64[(which, layer)] = (side, side.synthesis[0].astype(np.float64), side.mean[0].astype(np.float64))
        _, synthesis, mean = self._f64[(which, layer)]
        return synthesis, mean

    def coefficient_query(self, backend: Backend, layer: int, q: Any) -> tuple[Any, np.ndarray]:
        """Queries in a kltq K format's coefficient space, ``S^T q`` per KV head (what a backend scores against
        the decoded coefficients), and ``q . mu`` per query row and head (float64 ``[n, Hq]``): the score term
        the coefficients leave out, the same for every key (it matters only where scores are merged across
        parts by log-sum-exp)."""
        synthesis, mean = self._side_f64(layer, "k")
        qh = np.asarray(backend.to_numpy(q), np.float64)
        n, n_heads, d = qh.shape
        grouped = qh.reshape(n, self.spec.n_kv_heads, n_heads // self.spec.n_kv_heads, d)  # [n, H, G, D]
        offset = (grouped * mean[None, :, None, :]).sum(-1).reshape(n, n_heads)
        q_c = (grouped @ synthesis[None]).reshape(n, n_heads, d)  # S^T q per head: kltq.query, as one matmul
        return backend.asarray(q_c.astype(np.float32), "q"), offset

    def output(self, backend: Backend, layer: int, out: Any) -> Any:
        """Attention over stored V ``R (v / s)`` back to values: ``s * R^T out`` per KV head (exact). A kltq V
        format: attention over its decoded coefficients ``o' = sum_j p_j c'_j`` back to ``mean + S o'`` (exact:
        the softmax weights sum to 1)."""
        if self.spec.v_codec:
            return backend.asarray(self.coefficient_output(layer, backend.to_numpy(out)), "out")
        return self._heads(backend, layer, "v", out)

    def coefficient_output(self, layer: int, out: np.ndarray) -> np.ndarray:
        """Attention outputs ``[n, Hq, D]`` over a kltq V format's decoded coefficients, host f32, to values:
        ``mean + S o'`` per KV head (query heads grouped), in float64."""
        synthesis, mean = self._side_f64(layer, "v")
        o = np.asarray(out, np.float64)
        n, n_heads, d = o.shape
        grouped = o.reshape(n, self.spec.n_kv_heads, n_heads // self.spec.n_kv_heads, d)  # [n, H, G, D]
        x = grouped @ synthesis.transpose(0, 2, 1)[None] + mean[None, :, None, :]
        return x.reshape(n, n_heads, d).astype(np.float32)

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
