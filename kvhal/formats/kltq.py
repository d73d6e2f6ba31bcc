"""kltq: a static transform codec (per-layer, per-head KLT + reverse water-filling + Lloyd-Max), numpy reference.

This module *is* the spec of the codec's bytes and of its calibration. It is a codec with side data, not a
stateless block format: what a row's bytes mean depends on its layer's and head's calibration (``Side``).

Per layer ``l`` and KV head ``h``, calibrated once (``calibrate``) on a store of keys (and, query-weighted,
the queries that read them):

- ``mean`` ``mu`` (removed before coding; free in attention: ``q . mu`` is the same for every key);
- a basis: with ``W = (E[q q^T] + ridge)^(1/2)`` over the head's query heads (``weighted``; else ``W = I``) and
  ``W Cov(k) W = U diag(lam) U^T``, the coefficients ``c = T (x - mu)``, ``T = U^T W`` (analysis), and
  ``x = mu + S c``, ``S = W^-1 U`` (synthesis). ``sum_i (c_i - c'_i)^2`` is then ``E_q[(q . (x - x'))^2]``:
  the squared score error, averaged over the head's queries;
- integer bits ``b_i`` in 0..MAX_BITS (12) per coefficient, ``sum_i b_i = bits * head_dim`` (one fixed-size record per
  row, no per-token scale), by reverse water-filling: greedy on ``lam_i (d(b) - d(b+1))``, ``d`` the
  Gaussian Lloyd-Max distortion (optimal for a convex ``d``);
- per layer, one Lloyd-Max codebook per bit width on the normalized coefficients ``c_i / sqrt(lam_i)`` of
  every head's coefficients of that width: Lloyd's iteration on their kernel density estimate, initialised
  from its ``p^(1/3)`` point density (``fit_codebook``), so the levels reach every sample, sink-like outliers
  included.

A row (one token of one KV head) is ``bits * head_dim / 8`` bytes: coefficient ``i`` in index order takes
``b_i`` bits, code ``j`` = index of the nearest codebook level (ties: the lower), written LSB-first into a
little-endian bit stream; unused trailing bits are zero. Decoded: ``c'_i = sqrt(lam_i) * codebook[b_i][j]``
(``0`` for ``b_i = 0``), ``x' = mu + S c'``. Attention scores ``q . x'`` as ``(S^T q) . c' + q . mu``:
q is transformed once per call and scored against the decoded coefficients; the ``q . mu`` term is the same
for every key and cancels in the softmax. For V, ``sum_j p_j x'_j = mu + S (sum_j p_j c'_j)``.
"""

from __future__ import annotations

import hashlib
import io
import math
import numbers
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DTypeError, FormatError, KVHalError, NonFiniteError, ShapeError, SpecError
from ..interop import to_numpy
from ..validate import count, is_int

MAX_BITS = 12  # bits per coefficient (at 8, 39% of SmolLM2's coefficients hit the cap at a 7-bit budget)
MAX_BUDGET = 8.0  # bits per value
HIST_BINS = 4096
LLOYD_ITERS = 40
KDE_REACH = 4.0  # kernel bandwidths: the codebook density reaches this far past the extreme samples
RIDGE = 1e-3  # of E[qq^T]'s mean eigenvalue, so W^-1 stays bounded
BUDGETS = tuple(x / 2 for x in range(4, 17))  # 2.0, 2.5, ..., 8.0 bits per value
PREFIX = "kltq"


def names() -> list[str]:
    """Every offered budget as its own name: ``kltq:2``, ``kltq:2.5``, ..., ``kltq:8``."""
    return [f"{PREFIX}:{b:g}" for b in BUDGETS]


def parse_name(name: str) -> float:
    """The budget (bits per value) of a ``kltq:B`` name; FormatError otherwise."""
    if not isinstance(name, str):
        raise FormatError(f"a kltq format name is a str such as 'kltq:4.5', not {type(name).__name__} {name!r:.40}")
    prefix, _, rest = name.partition(":")
    try:
        bits = float(rest)
    except ValueError:
        bits = math.nan
    if prefix != PREFIX or not (2 <= bits <= MAX_BUDGET) or (bits * 8) % 1:
        raise FormatError(
            f"{name!r} is not a kltq budget: write kltq:B with B from 2 to {MAX_BUDGET:g} in steps of 1/8 "
            f"(offered: {', '.join(names())})"
        )
    return bits


def _budget(bits: Any, what: str) -> float:
    """``bits`` (any real number) as a float budget: SpecError for no number, FormatError for no budget."""
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, numbers.Real):
        raise SpecError(f"{what} must be a kltq budget (a number), got {bits!r}")
    try:
        b = float(bits)
    except OverflowError:  # an int past float's range: no budget, refused just below
        b = math.inf
    parse_name(f"{PREFIX}:{b!r}")  # FormatError unless a budget (repr: exactly this float)
    return b


def row_bytes(bits: float, head_dim: int) -> int:
    """Bytes of one record: ``bits * head_dim / 8``; FormatError when that is no whole number of bytes."""
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, numbers.Real) or not is_int(head_dim):
        raise FormatError(f"kltq row_bytes takes a number of bits and an int head_dim, got {bits!r}, {head_dim!r}")
    total = bits * head_dim
    if total % 8 or head_dim < 1:
        raise FormatError(
            f"kltq:{bits:g} with head_dim {head_dim}: bits * head_dim = {total:g} is not a whole number of bytes; "
            "pick a budget whose bits * head_dim is a multiple of 8"
        )
    return int(total) // 8


# -- Gaussian Lloyd-Max ----------------------------------------------------------------------------------


def lloyd(
    x: np.ndarray, w: np.ndarray, levels: int, iters: int = LLOYD_ITERS, start: np.ndarray | None = None
) -> np.ndarray:
    """Lloyd-Max levels (ascending) for weighted points ``x`` (sorted), started from ``start`` or else the
    ``p^(1/3)`` point density of the weights (the high-rate optimum)."""
    if start is None:
        cdf = np.cumsum(np.cbrt(w))
        cdf /= cdf[-1]
        c = np.interp((np.arange(levels) + 0.5) / levels, cdf, x)
    else:
        c = np.asarray(start, np.float64)
    for _ in range(iters):
        cells = np.searchsorted((c[1:] + c[:-1]) / 2, x, side="left")
        num = np.bincount(cells, weights=w * x, minlength=levels)
        den = np.bincount(cells, weights=w, minlength=levels)
        c = np.where(den > 0, num / np.where(den > 0, den, 1), c)
        c = np.sort(c)
    return c


def fit_codebook(z: np.ndarray, bits: int) -> np.ndarray:
    """Lloyd-Max levels for samples ``z`` on their kernel density estimate: a ``HIST_BINS``-bin histogram over
    the samples' range widened by ``KDE_REACH`` bandwidths, smoothed by a Gaussian kernel of Silverman's
    bandwidth, then ``LLOYD_ITERS`` Lloyd iterations on it started from its ``p^(1/3)`` point density. The
    levels span every sample (a cluster of sink-like keys at 5 sigma is not clipped) whatever the number of
    samples per level; fewer than two distinct samples take the Gaussian codebook."""
    z = np.asarray(z, np.float64).ravel()
    iqr = float(np.subtract(*np.percentile(z, [75, 25]))) if z.size else 0.0
    spread = min(float(z.std()), iqr / 1.34) if iqr > 0 else float(z.std()) if z.size else 0.0
    if z.size < 2 or not spread > 0:
        return gaussian_codebook(bits)
    bw = 0.9 * spread * z.size**-0.2  # Silverman's rule
    lo, hi = float(z.min()) - KDE_REACH * bw, float(z.max()) + KDE_REACH * bw
    hist, edges = np.histogram(z, bins=HIST_BINS, range=(lo, hi))
    x = (edges[1:] + edges[:-1]) / 2
    reach = int(math.ceil(KDE_REACH * bw / (x[1] - x[0])))
    kernel = np.exp(-0.5 * (np.arange(-reach, reach + 1) * (x[1] - x[0]) / bw) ** 2)
    w = np.convolve(hist.astype(np.float64), kernel, mode="same")
    return lloyd(x, w, 1 << bits, start=lloyd(x, w, 1 << bits, iters=0))


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gauss_cells(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Probability and centroid of N(0, 1) in each cell of the levels ``c`` (thresholds at the midpoints)."""
    t = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
    cdf = 0.5 * (1 + _erf(t / math.sqrt(2)))
    pdf = np.exp(-0.5 * np.where(np.isfinite(t), t, 0) ** 2) / math.sqrt(2 * math.pi) * np.isfinite(t)
    prob = np.diff(cdf)
    return prob, (pdf[:-1] - pdf[1:]) / np.maximum(prob, 1e-300)


_GAUSS: dict[int, np.ndarray] = {}


def gaussian_codebook(bits: int) -> np.ndarray:
    """The Lloyd-Max levels of N(0, 1) at ``bits`` bits: Lloyd's iteration on the exact cell centroids (erf),
    started from the ``p^(1/3)`` point density (a Gaussian of variance 3), computed once per width."""
    if bits not in _GAUSS:
        levels = 1 << bits
        u = (np.arange(levels) + 0.5) / levels
        # quantiles of N(0, 3) by bisection on erf
        lo, hi = np.full(levels, -40.0), np.full(levels, 40.0)
        for _ in range(80):
            mid = (lo + hi) / 2
            below = 0.5 * (1 + _erf(mid / math.sqrt(6))) < u
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        c = (lo + hi) / 2
        for _ in range(400):
            c, last = _gauss_cells(c)[1], c
            if np.abs(c - last).max() < 1e-10:
                break
        _GAUSS[bits] = c
    return _GAUSS[bits]


def gaussian_distortion(bits: int) -> float:
    """Mean squared error of N(0, 1) through its ``bits``-bit Lloyd-Max quantizer (1.0 at 0 bits): at the
    centroids, ``1 - sum_i P_i c_i^2``."""
    if bits == 0:
        return 1.0
    prob, cent = _gauss_cells(gaussian_codebook(bits))
    return float(1 - (prob * cent**2).sum())


_DIST: list[float] = []


def _distortions() -> list[float]:
    if not _DIST:
        _DIST.extend(gaussian_distortion(b) for b in range(MAX_BITS + 1))
    return _DIST


def allocate(lam: np.ndarray, total: int) -> np.ndarray:
    """Integer bits per coefficient (0..MAX_BITS) summing to ``min(total, MAX_BITS * n)``: greedy reverse
    water-filling on the Gaussian Lloyd-Max distortion ``lam_i * d(b_i)`` (ties: the lower index)."""
    d = _distortions()
    lam = np.asarray(lam, np.float64)
    b = np.zeros(len(lam), np.int64)
    for _ in range(min(total, MAX_BITS * len(lam))):
        gain = np.where(b < MAX_BITS, lam * (np.take(d, b) - np.take(d, np.minimum(b + 1, MAX_BITS))), -1.0)
        b[int(np.argmax(gain))] += 1
    return b


# -- side data -------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Side:
    """One cache's calibration: per layer and KV head ``mean [L,H,D]``, ``analysis``/``synthesis [L,H,D,D]``
    (``c = T (x - mu)``, ``x = mu + S c``), ``sigma [L,H,D]`` (sqrt of each coefficient's variance),
    ``alloc [L,H,D]`` (bits), and per layer ``codebooks [L, MAX_BITS+1, 2^MAX_BITS]`` (row b: the 2^b levels
    of width b, then zeros). ``bits`` is the budget, ``weighted`` whether the basis is query-weighted."""

    bits: float
    weighted: bool
    mean: np.ndarray
    analysis: np.ndarray
    synthesis: np.ndarray
    sigma: np.ndarray
    alloc: np.ndarray
    codebooks: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", _budget(self.bits, "kltq side data: bits"))
        if not isinstance(self.weighted, (bool, np.bool_)):
            raise SpecError(f"kltq side data: weighted must be a bool, got {self.weighted!r}")
        object.__setattr__(self, "weighted", bool(self.weighted))
        fields = ("mean", "analysis", "synthesis", "sigma", "alloc", "codebooks")
        for name in fields:
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype.kind not in "iuf":
                raise ShapeError(f"kltq side data: {name} must be a real numpy array, got {type(a).__name__} "
                                 f"{getattr(a, 'dtype', '')}")  # fmt: skip
        if self.mean.ndim != 3 or 0 in self.mean.shape:
            raise ShapeError(
                f"kltq side data: mean must be [layers, heads, head_dim], each >= 1, got {self.mean.shape}"
            )
        L, H, D = self.mean.shape
        want = {
            "analysis": (L, H, D, D),
            "synthesis": (L, H, D, D),
            "sigma": (L, H, D),
            "alloc": (L, H, D),
            "codebooks": (L, MAX_BITS + 1, 1 << MAX_BITS),
        }
        for name, shape in want.items():
            a = getattr(self, name)
            if a.shape != shape:
                raise ShapeError(f"kltq side data: {name} must be an array of shape {shape}, got {a.shape}")
        # checked before the cast to u8, which would wrap 256 to 0 and drop fractions
        alloc = self.alloc
        if (alloc != np.floor(alloc)).any() or (alloc < 0).any() or (alloc > MAX_BITS).any():
            raise ShapeError(f"kltq side data: alloc must hold whole bits 0..{MAX_BITS}")
        if (alloc.astype(np.int64).sum(axis=2) > self.bits * D).any():
            raise ShapeError(f"kltq side data: a head's bits exceed the budget {self.bits:g} x {D}")
        # read-only copies in the dtypes the spec's arithmetic and the backends' kernels read (the cpu backend
        # hands these buffers to C as f32/u8): a float64 or int64 array with the same digest would otherwise
        # store other bytes there, and a caller's later write would change the bytes a fingerprint named
        for name in fields:
            with np.errstate(over="ignore"):  # beyond f32's range: inf, refused just below
                a = np.array(getattr(self, name), np.uint8 if name == "alloc" else np.float32, order="C")
            a.setflags(write=False)
            object.__setattr__(self, name, a)
            if not np.isfinite(a).all():  # after the cast: a float64 beyond f32's range is inf there
                raise NonFiniteError(f"kltq side data: {name} holds NaN/inf (in float32); calibrate it again")
        if (self.sigma < 0).any():
            raise ShapeError("kltq side data: sigma (the square root of each coefficient's variance) must be >= 0")
        # nearest-level search (the numpy spec's and every kernel's) assumes each width's levels in order
        for b in range(1, MAX_BITS + 1):
            if (np.diff(self.codebooks[:, b, : 1 << b], axis=-1) < 0).any():
                raise ShapeError(f"kltq side data: codebook levels of width {b} must be ascending")

    def __repr__(self) -> str:
        L, H, D = self.shape
        kind = "query-weighted" if self.weighted else "plain"
        return f"kltq.Side(kltq:{self.bits:g}, {kind}, layers={L}, heads={H}, head_dim={D}, {self.digest()[:19]})"

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(n_layers, n_kv_heads, head_dim)``."""
        L, H, D = self.mean.shape
        return int(L), int(H), int(D)

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.bits, self.shape[2])

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "bits": np.array(self.bits, np.float64),
            "weighted": np.array(self.weighted),
            "mean": self.mean.astype(np.float32),
            "analysis": self.analysis.astype(np.float32),
            "synthesis": self.synthesis.astype(np.float32),
            "sigma": self.sigma.astype(np.float32),
            "alloc": self.alloc.astype(np.uint8),
            "codebooks": self.codebooks.astype(np.float32),
        }

    def digest(self) -> str:
        """``sha256:<hex>`` of the side data's arrays (names, dtypes, shapes and bytes, in a fixed order):
        what names it in a fingerprint."""
        h = hashlib.sha256(b"kvhal-kltq-side\0")
        for name, a in sorted(self.arrays().items()):
            a = np.ascontiguousarray(a)
            h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
            h.update(a.tobytes())
        return "sha256:" + h.hexdigest()

    def save(self, path: Any) -> None:
        """Write the side data as an .npz (what ``kvhal eval --calibrate`` writes); SpecError when ``path`` is no
        path or cannot be written."""
        if not isinstance(path, (str, bytes, os.PathLike)):  # open() takes an int as a descriptor: True is stdout
            raise SpecError(f"Side.save takes a file path, not {type(path).__name__} {path!r:.40}")
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=False, **self.arrays())
        try:
            with open(path, "wb") as f:
                f.write(buf.getvalue())
        except OSError as e:
            raise SpecError(f"cannot write kltq side data to {path!r} ({e}); pass a writable file path") from None

    @classmethod
    def load(cls, path: Any) -> Side:
        """The side data ``save`` wrote to ``path`` (a path or a binary file); SpecError when it cannot be read or
        is not whole (truncated, bit-flipped: the .npz's CRCs)."""
        if not isinstance(path, (str, bytes, os.PathLike)) and not hasattr(path, "read"):
            raise SpecError(f"Side.load takes a file path, not {type(path).__name__} {path!r:.40}")
        try:
            z = np.load(path, allow_pickle=False)
            if not isinstance(z, np.lib.npyio.NpzFile):  # a lone .npy array
                raise ValueError("not an .npz of side data")
            with z:
                a = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise SpecError(
                f"kltq calibration file {path!r} cannot be read ({e}); write one with kvhal eval --calibrate"
            ) from None
        return from_arrays(a, f"calibration file {path!r}")


# -- calibration -----------------------------------------------------------------------------------------


def _sqrtm(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric square root of a PSD matrix and its inverse (eigenvalues floored at RIDGE x mean)."""
    w, u = np.linalg.eigh((m + m.T) / 2)
    w = np.maximum(w, RIDGE * max(float(w.mean()), 1e-30))
    return (u * np.sqrt(w)) @ u.T, (u / np.sqrt(w)) @ u.T


def basis(k: np.ndarray, q: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One head's ``(mean, T, S, lam)`` from keys ``k [n, D]`` and its queries ``q [m, D]`` (None: plain KLT),
    float64; ``lam`` descending."""
    k = np.asarray(k, np.float64)
    mu = k.mean(axis=0)
    cov = np.cov(k, rowvar=False, bias=True).reshape(k.shape[1], k.shape[1])
    if q is None:
        w, w_inv = np.eye(k.shape[1]), np.eye(k.shape[1])
    else:
        q = np.asarray(q, np.float64)
        w, w_inv = _sqrtm(q.T @ q / len(q))
    lam, u = np.linalg.eigh(w @ cov @ w)
    order = np.argsort(-lam, kind="stable")
    lam, u = np.maximum(lam[order], 0.0), u[:, order]
    # a fixed sign per basis vector (largest |entry| positive), so calibration is deterministic
    u = u * np.where(u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])] < 0, -1.0, 1.0)
    return mu, u.T @ w, w_inv @ u, lam


def _real(x: Any, what: str, finite: bool = True) -> np.ndarray:
    """``x`` as a numpy array of (``finite``: finite) real numbers: DTypeError (strings, objects, ragged lists),
    NonFiniteError."""
    try:
        a = to_numpy(x)  # torch too: one that requires grad or holds bfloat16 is no raw RuntimeError/TypeError
    except DTypeError:
        a = np.asarray(None)
    if a.dtype.kind not in "iuf":
        raise DTypeError(f"{what} must be an array of real numbers, got {type(x).__name__} of {a.dtype}")
    if finite and not np.isfinite(a).all():
        raise NonFiniteError(f"{what} hold NaN/inf: kltq calibrates and stores finite values only")
    return a


def calibrate(
    k: list[np.ndarray] | tuple[np.ndarray, ...],
    bits: float,
    q: list[np.ndarray] | tuple[np.ndarray, ...] | None = None,
    skip: int = 0,
) -> Side:
    """Side data from each layer's keys ``k[l] [n, H, D]`` (and queries ``q[l] [n, Hq, D]``, ``Hq`` a multiple of
    ``H``: query-weighted), skipping the first ``skip`` tokens (the f16 sinks)."""
    bits = _budget(bits, "bits")
    skip = count(skip, "skip")
    if not isinstance(k, (list, tuple)) or not k:
        raise ShapeError("calibrate needs a list of each layer's keys [n, H, D], at least one layer")
    k = [_real(x, f"calibrate: layer {i}'s keys") for i, x in enumerate(k)]
    if k[0].ndim != 3 or 0 in k[0].shape[1:]:
        raise ShapeError(f"calibrate: layer 0's keys are {k[0].shape}, expected [n, H, D] with H, D >= 1")
    n, H, D = k[0].shape
    row_bytes(bits, D)
    for layer, kl in enumerate(k):
        if kl.ndim != 3 or kl.shape[1:] != (H, D):
            raise ShapeError(f"calibrate: layer {layer}'s keys are {kl.shape}, expected [n, {H}, {D}]")
        if kl.shape[0] - skip < 2:
            raise ShapeError(f"calibrate needs at least 2 tokens after the {skip} sink(s), got {kl.shape[0]}")
    if q is not None:
        # each layer's queries weight its keys' error: one per key token, heads grouped onto the KV heads
        if not isinstance(q, (list, tuple)) or len(q) != len(k):
            raise ShapeError(
                f"calibrate: q must be a list of {len(k)} layers' queries [n, Hq, {D}], one per layer of k"
            )
        q = [_real(x, f"calibrate: layer {i}'s queries") for i, x in enumerate(q)]
        for layer, (ql, kl) in enumerate(zip(q, k)):
            if ql.ndim != 3 or ql.shape[0] != kl.shape[0] or ql.shape[2] != D or not ql.shape[1] or ql.shape[1] % H:
                raise ShapeError(
                    f"calibrate: layer {layer}'s queries are {ql.shape}, expected [{kl.shape[0]}, Hq, {D}] with Hq a "
                    f"multiple of the {H} KV heads"
                )
    L = len(k)
    mean = np.zeros((L, H, D))
    T = np.zeros((L, H, D, D))
    S = np.zeros((L, H, D, D))
    sigma = np.zeros((L, H, D))
    alloc = np.zeros((L, H, D), np.uint8)
    books = np.zeros((L, MAX_BITS + 1, 1 << MAX_BITS))
    for layer, kl in enumerate(k):
        kl = np.asarray(kl, np.float64)[skip:]
        coeffs = []
        for h in range(H):
            qh = None
            if q is not None:
                ql = np.asarray(q[layer], np.float64)[skip:]
                g = ql.shape[1] // H
                qh = ql[:, h * g : (h + 1) * g].reshape(-1, D)
            mean[layer, h], T[layer, h], S[layer, h], lam = basis(kl[:, h], qh)
            sigma[layer, h] = np.sqrt(lam)
            alloc[layer, h] = allocate(lam, int(round(bits * D)))
            coeffs.append((kl[:, h] - mean[layer, h]) @ T[layer, h].T)
        for b in range(1, MAX_BITS + 1):
            z = [
                coeffs[h][:, alloc[layer, h] == b] / np.where(sigma[layer, h][alloc[layer, h] == b] > 0,
                                                           sigma[layer, h][alloc[layer, h] == b], 1.0)
                for h in range(H)
            ]  # fmt: skip
            books[layer, b, : 1 << b] = fit_codebook(np.concatenate([x.ravel() for x in z]), b)
    f32 = np.float32
    return Side(bits, q is not None, mean.astype(f32), T.astype(f32), S.astype(f32), sigma.astype(f32), alloc,
                books.astype(f32))  # fmt: skip


# -- the record ------------------------------------------------------------------------------------------


def _at(side: Any, layer: Any, what: str) -> int:
    """``layer`` of ``side`` as a plain int: SpecError for no Side, ShapeError for a layer it lacks (a bool, a
    float, a negative index)."""
    if not isinstance(side, Side):
        raise SpecError(f"kltq {what}: side is a kvhal.formats.kltq.Side, not {type(side).__name__}")
    if not is_int(layer) or not 0 <= layer < side.shape[0]:
        raise ShapeError(f"kltq {what}: layer {layer!r} is not one of the side data's layers 0..{side.shape[0] - 1}")
    return int(layer)


def _rows(side: Side, x: Any, what: str, grouped: bool = False) -> np.ndarray:
    """``x [n, H, D]`` (``grouped``: ``[n, Hq, D]``, ``Hq`` a multiple of ``H``) as a real array; DTypeError or
    ShapeError otherwise."""
    a = _real(x, f"kltq {what}: rows", finite=False)
    _, H, D = side.shape
    if a.ndim != 3 or a.shape[2] != D or (a.shape[1] % H or not a.shape[1] if grouped else a.shape[1] != H):
        heads = f"Hq (a multiple of {H})" if grouped else str(H)
        raise ShapeError(f"kltq {what}: rows must be [n, {heads}, {D}], got {a.shape}")
    return a


def coefficients(side: Side, layer: int, x: np.ndarray) -> np.ndarray:
    """``c = T (x - mu)`` per head of ``x [n, H, D]``, float64."""
    layer = _at(side, layer, "coefficients")
    x = _rows(side, x, "coefficients").astype(np.float64) - side.mean[layer].astype(np.float64)[None]
    return np.einsum("hij,nhj->nhi", side.analysis[layer].astype(np.float64), x)


def _codes(side: Side, layer: int, c: np.ndarray) -> np.ndarray:
    """Nearest-level codes ``[n, H, D]`` (int64) of coefficients ``c``; 0 where a coefficient has no bits."""
    _, H, D = side.shape
    sig = side.sigma[layer].astype(np.float64)
    z = c / np.where(sig > 0, sig, 1.0)[None]
    out = np.zeros(c.shape, np.int64)
    alloc = side.alloc[layer]
    for b in range(1, MAX_BITS + 1):
        sel = alloc == b
        if not sel.any():
            continue
        lv = side.codebooks[layer, b, : 1 << b].astype(np.float64)
        mids = (lv[1:] + lv[:-1]) / 2
        out[:, sel] = np.searchsorted(mids, z[:, sel], side="left")
    return out


def _stream_positions(width: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For one head's widths ``[D]``: each stream bit's coefficient, bit index and position (LSB first)."""
    width = width.astype(np.int64)
    coef = np.repeat(np.arange(len(width)), width)
    start = np.concatenate([[0], np.cumsum(width)[:-1]])
    bit = np.arange(int(width.sum())) - np.repeat(start, width)
    return coef, bit, np.arange(int(width.sum()))


CHUNK = 4096  # rows per step of pack/unpack (bounds the temporary bit arrays)


def pack(codes: np.ndarray, alloc: np.ndarray, nbytes: int) -> np.ndarray:
    """Codes ``[n, H, D]`` with widths ``alloc [H, D]`` into LSB-first bit streams ``[n, H, nbytes]`` u8."""
    n, H, _ = codes.shape
    out = np.zeros((n, H, nbytes), np.uint8)
    for h in range(H):
        coef, bit, _ = _stream_positions(alloc[h])
        for r in range(0, n, CHUNK):
            stream = np.zeros((min(CHUNK, n - r), nbytes * 8), np.uint8)
            stream[:, : len(coef)] = (codes[r : r + CHUNK, h][:, coef] >> bit) & 1
            out[r : r + CHUNK, h] = np.packbits(stream, axis=1, bitorder="little")
    return out


def unpack(data: np.ndarray, alloc: np.ndarray) -> np.ndarray:
    """Bit streams ``[n, H, nbytes]`` back to codes ``[n, H, D]`` (int64): the stream times the matrix that puts
    bit ``j`` of coefficient ``i`` at weight ``2^j`` (exact in float64)."""
    n, H, _ = data.shape
    D = alloc.shape[1]
    out = np.zeros((n, H, D), np.int64)
    for h in range(H):
        coef, bit, pos = _stream_positions(alloc[h])
        weights = np.zeros((len(pos), D))
        weights[pos, coef] = np.exp2(bit)
        for r in range(0, n, CHUNK):
            bits = np.unpackbits(np.ascontiguousarray(data[r : r + CHUNK, h]), axis=1, bitorder="little")
            out[r : r + CHUNK, h] = np.rint(bits[:, : len(pos)].astype(np.float64) @ weights).astype(np.int64)
    return out


def quantize(side: Side, layer: int, x: np.ndarray) -> np.ndarray:
    """Rows ``x [n, H, D]`` (finite) into records ``[n, H, row_bytes]`` u8."""
    layer = _at(side, layer, "quantize")
    with np.errstate(over="ignore"):  # beyond f32's range: inf, refused below
        x = _rows(side, x, "quantize").astype(np.float32)
    if not np.isfinite(x).all():
        raise NonFiniteError("kltq stores finite values only: find the NaN/inf upstream")
    return pack(_codes(side, layer, coefficients(side, layer, x)), side.alloc[layer], side.row_bytes)


def decode_coefficients(side: Side, layer: int, data: np.ndarray) -> np.ndarray:
    """Records ``[n, H, row_bytes]`` to decoded coefficients ``c'`` ``[n, H, D]`` float32 (what attention scores
    against, after ``query``)."""
    layer = _at(side, layer, "decode_coefficients")
    _, H, D = side.shape
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:  # a cast would wrap or truncate other dtypes
        raise DTypeError(
            f"kltq records must be a uint8 numpy array, got {type(data).__name__} {getattr(data, 'dtype', '')}"
        )
    if data.ndim != 3 or data.shape[1:] != (H, side.row_bytes):
        raise ShapeError(f"kltq records must be [n, {H}, {side.row_bytes}] u8, got {data.shape}")
    codes = unpack(data, side.alloc[layer])
    books = side.codebooks[layer].astype(np.float32)  # [MAX_BITS+1, 256]
    width = side.alloc[layer].astype(np.int64)
    z = books[width[None], codes]  # [n, H, D]
    return np.where(width[None] > 0, z * side.sigma[layer][None], 0.0).astype(np.float32)


def synthesize(side: Side, layer: int, c: np.ndarray) -> np.ndarray:
    """``x = mu + S c`` per head, float32."""
    layer = _at(side, layer, "synthesize")
    s = side.synthesis[layer].astype(np.float64)
    x = (
        np.einsum("hij,nhj->nhi", s, _rows(side, c, "synthesize").astype(np.float64))
        + side.mean[layer].astype(np.float64)[None]
    )
    return x.astype(np.float32)


def dequantize(side: Side, layer: int, data: np.ndarray) -> np.ndarray:
    """Records ``[n, H, row_bytes]`` back to values ``[n, H, D]`` f32: ``mu + S c'``."""
    return synthesize(side, layer, decode_coefficients(side, layer, data))


def query(side: Side, layer: int, q: np.ndarray) -> np.ndarray:
    """Queries ``[n, Hq, D]`` in coefficient space, ``S^T q`` per KV head (query heads grouped), float32: scores
    against decoded coefficients equal scores against ``x' - mu``."""
    layer = _at(side, layer, "query")
    _, H, _ = side.shape
    q = _rows(side, q, "query", grouped=True).astype(np.float64)
    g = q.shape[1] // H
    s = np.repeat(side.synthesis[layer].astype(np.float64), g, axis=0)  # [Hq, D, D]
    return np.einsum("hji,nhj->nhi", s, q).astype(np.float32)


# -- the Gaussian rate-distortion limit ------------------------------------------------------------------


def water_level(lam: np.ndarray, rate: float) -> np.ndarray:
    """Per-coefficient distortion ``min(theta, lam_i)`` of reverse water-filling at ``rate`` bits in all
    (``sum_i max(0, log2(lam_i / theta) / 2) = rate``), by bisection on ``log theta``."""
    lam = np.asarray(lam, np.float64)
    pos = lam[lam > 0]
    if pos.size == 0:
        return np.zeros_like(lam)
    lo, hi = math.log(pos.min()) - 2 * rate - 10, math.log(pos.max())
    for _ in range(200):
        mid = (lo + hi) / 2
        r = np.maximum(0.0, (np.log(pos) - mid) / (2 * math.log(2))).sum()
        lo, hi = (mid, hi) if r > rate else (lo, mid)
    return np.minimum(lam, math.exp(hi))


def rd_channel(k: np.ndarray, q: np.ndarray, bits: float, skip: int = 0, seed: int = 0) -> np.ndarray:
    """Keys ``k [n, H, D]`` through the Gaussian test channel of query-weighted reverse water-filling at
    ``bits`` per value (each head's own covariance and queries ``q [n, Hq, D]``), the first ``skip`` kept
    exact: what an ideal fixed-rate coder of Gaussian keys would hand attention. For ``c ~ N(0, lam)``:
    ``c' = (1 - D/lam) (c + n)``, ``n ~ N(0, D lam / (lam - D))``, so ``E(c - c')^2 = D``."""
    rng = np.random.default_rng(seed)
    k = np.asarray(k, np.float64)
    out = k.copy()
    n, H, D = k.shape
    g = q.shape[1] // H
    for h in range(H):
        mu, T, S, lam = basis(k[skip:, h], np.asarray(q[skip:, h * g : (h + 1) * g], np.float64).reshape(-1, D))
        dist = water_level(lam, bits * D)
        c = (k[skip:, h] - mu) @ T.T
        live = lam > dist
        a = np.where(live, 1 - dist / np.where(lam > 0, lam, 1), 0.0)
        noise_var = np.where(live, dist * lam / np.where(live, lam - dist, 1), 0.0)
        c2 = a * (c + rng.standard_normal(c.shape) * np.sqrt(noise_var))
        out[skip:, h] = mu + c2 @ S.T
    return out


# -- per-layer side data (what a cache calibrates a layer at a time) ------------------------------------


def layer_side(side: Side, layer: int) -> Side:
    """Layer ``layer`` of ``side`` as a one-layer Side (what a backend's ``Pools.side[layer]`` holds)."""
    layer = _at(side, layer, "layer_side")
    sl = slice(layer, layer + 1)
    return Side(side.bits, side.weighted, side.mean[sl], side.analysis[sl], side.synthesis[sl], side.sigma[sl],
                side.alloc[sl], side.codebooks[sl])  # fmt: skip


def join_layers(layers: list[Side]) -> Side:
    """One Side from one-layer Sides in layer order (a cache's, once every layer calibrated)."""
    if (
        not isinstance(layers, (list, tuple))
        or not all(isinstance(x, Side) for x in layers)
        or len({(x.bits, x.weighted, x.shape[1:]) for x in layers}) != 1
    ):
        raise ShapeError("join_layers takes a list of one or more Sides of one budget, weighting, heads and head_dim")
    cat = [np.concatenate([getattr(x, f) for x in layers]) for f in
           ("mean", "analysis", "synthesis", "sigma", "alloc", "codebooks")]  # fmt: skip
    return Side(layers[0].bits, layers[0].weighted, *cat)


def from_arrays(a: dict[str, np.ndarray], where: str) -> Side:
    """A Side from the arrays ``Side.arrays`` gives (a calibration file's, a snapshot's); SpecError names ``where``
    when some are missing or malformed."""
    if not isinstance(a, dict):
        raise SpecError(f"kltq side data in {where}: from_arrays takes a dict of arrays, not {type(a).__name__}")
    missing = {"bits", "weighted", "mean", "analysis", "synthesis", "sigma", "alloc", "codebooks"} - set(a)
    if missing:
        raise SpecError(f"kltq side data in {where} lacks {sorted(missing)}; write it with kvhal eval --calibrate")
    bits, weighted = (np.asarray(a[n]) for n in ("bits", "weighted"))  # 0-d in an .npz, [1] or 0-d in a snapshot
    try:
        if bits.size != 1 or bits.dtype.kind not in "iuf" or weighted.size != 1 or weighted.dtype.kind != "b":
            raise SpecError("bits must be one number and weighted one bool")
        # the arrays as stored: Side checks them before its casts (a u8 cast here would wrap alloc's 256 to 0)
        return Side(float(bits.reshape(-1)[0]), bool(weighted.reshape(-1)[0]),
                    *(np.asarray(a[n]) for n in ("mean", "analysis", "synthesis", "sigma", "alloc", "codebooks")))  # fmt: skip
    except KVHalError as e:
        raise SpecError(
            f"kltq side data in {where} is malformed ({e}); write it again with kvhal eval --calibrate"
        ) from None
