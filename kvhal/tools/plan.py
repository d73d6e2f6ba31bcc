"""``kvhal plan``: the napkin math of a KV cache, before buying memory.

From a model shape (flags, or a Hugging Face ``config.json``) and KV formats: bytes per token, the
longest context one sequence fits in a memory budget (or how many sequences fit at a given context),
and the bandwidth-bound decode time per token on a device. Every byte count comes from the format
registry through ``CacheSpec``; none is re-typed here.

Paging: each layer holds whole pages of ``block_size`` tokens. A full-attention layer at context ``n``
holds ``ceil(n / B)`` pages. A sliding-window layer (window ``W``) holds the pages that cover its last
``W`` positions: at most ``ceil((W - 1) / B) + 1``, since a window straddles one page more than it
fills unless it is aligned. That assumes an engine that frees a page once it leaves every window
(per-layer-group page tables). kvhal's ``KVCache`` has one block table for all layers and keeps every
layer at full length: ``ModelShape.full_attention()`` (``--full-attention``) gives its figures.

Decode time is the time to read one sequence's K and V once per token at the device's read
bandwidth (sliding layers read their window only): a lower bound that leaves out the weights,
activations and compute. A batch of S sequences reads S times the bytes per step, so the aggregate
tokens/s is the same figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from .. import formats
from ..errors import PlanError
from ..spec import CacheSpec


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    read_bytes_per_s: float
    source: str


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "h100",
            "NVIDIA H100 SXM",
            3.35e12,
            "NVIDIA H100 Tensor Core GPU, H100 SXM: GPU memory bandwidth 3.35 TB/s "
            "(https://www.nvidia.com/en-us/data-center/h100/)",
        ),
        Device(
            "h200",
            "NVIDIA H200",
            4.8e12,
            "NVIDIA H200 Tensor Core GPU: GPU memory bandwidth 4.8 TB/s (https://www.nvidia.com/en-us/data-center/h200/)",
        ),
        Device(
            "b200",
            "NVIDIA B200",
            8e12,
            "NVIDIA DGX B200: 64 TB/s HBM3e over 8 B200 GPUs, 8 TB/s each "
            "(https://www.nvidia.com/en-us/data-center/dgx-b200/)",
        ),
        Device(
            "mi300x",
            "AMD Instinct MI300X",
            5.3e12,
            "AMD Instinct MI300X: peak theoretical memory bandwidth 5.3 TB/s "
            "(https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html)",
        ),
        Device(
            "rtx4090",
            "NVIDIA GeForce RTX 4090",
            1008e9,
            "NVIDIA Ada GPU Architecture whitepaper, GeForce RTX 4090: memory bandwidth 1008 GB/s "
            "(https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf)",
        ),
        Device(
            "m3max",
            "Apple M3 Max (16-core CPU, 40-core GPU)",
            400e9,
            "Apple MacBook Pro (14-inch, M3 Pro or M3 Max, Nov 2023) Tech Specs: M3 Max with 16-core CPU and "
            "40-core GPU, 400GB/s memory bandwidth (the 14-core CPU/30-core GPU M3 Max: 300GB/s) "
            "(https://support.apple.com/en-us/117736)",
        ),
    )
}
THIS = "this"  # this machine's read bandwidth, measured when asked for
THIS_PROBE_BYTES = 1 << 29


def device(name: str) -> Device:
    """A device from the table, or ``"this"``: host read bandwidth measured now (``kvhal.tools.bench.read_bandwidth``)."""
    if not isinstance(name, str):
        raise PlanError(f"a device is a name (str), got {name!r}")
    if name.lower() == THIS:
        from .bench import cpu_model, read_bandwidth  # numpy only; measured on demand

        threads = os.cpu_count() or 1
        return Device(
            THIS,
            f"this machine ({cpu_model()})",
            read_bandwidth(THIS_PROBE_BYTES, threads=threads),
            f"measured now: numpy sums over {THIS_PROBE_BYTES >> 20} MiB on {threads} threads, "
            "median of 9 (kvhal.tools.bench.read_bandwidth)",
        )
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown device {name!r}; known: {', '.join([*DEVICES, THIS])}") from None


def _positive(what: str, value: Any) -> int:
    """A positive int; a bool is not a count and a float is not a length."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """The KV shape of a model: ``windows[i]`` is layer i's sliding window in tokens, None for full attention."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]
    source: str = "flags"

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim"):
            _positive(f"ModelShape.{name}", getattr(self, name))
        if not isinstance(self.windows, tuple) or len(self.windows) != self.n_layers:
            raise PlanError(f"ModelShape.windows must be a tuple of {self.n_layers} windows (None: full attention)")
        for w in self.windows:
            if w is not None:
                _positive("a sliding window", w)

    @classmethod
    def uniform(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        sliding_layers: int | None = None,
    ) -> ModelShape:
        """``sliding_layers`` of the layers (default: all, when a window is given) slide over ``sliding_window``."""
        n = _positive("n_layers", n_layers)
        if sliding_window is None:
            if sliding_layers is not None:
                raise PlanError("sliding_layers needs a sliding_window (--sliding-window W)")
            return cls(n, n_kv_heads, head_dim, (None,) * n)
        w = _positive("sliding_window", sliding_window)
        s = n if sliding_layers is None else sliding_layers
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= n:
            raise PlanError(f"sliding_layers must be an int in 0..{n} (n_layers), got {sliding_layers!r}")
        return cls(n, n_kv_heads, head_dim, (w,) * s + (None,) * (n - s))

    @classmethod
    def from_layer_types(
        cls, n_kv_heads: int, head_dim: int, layer_types: Sequence[str], sliding_window: int | None
    ) -> ModelShape:
        """One entry per layer, "sliding"/"full" (or transformers' "sliding_attention"/"full_attention")."""
        if isinstance(layer_types, str) or not isinstance(layer_types, Sequence) or not layer_types:
            raise PlanError(f"layer_types must be a list of 'sliding'/'full' per layer, got {layer_types!r}")
        windows: list[int | None] = []
        for t in layer_types:
            kind = _LAYER_TYPES.get(t) if isinstance(t, str) else None
            if kind is None:
                raise PlanError(f"layer type {t!r} is not one of {', '.join(_LAYER_TYPES)}")
            if kind == "sliding" and sliding_window is None:
                raise PlanError("sliding layers need a window: pass --sliding-window W (config.json: sliding_window)")
            windows.append(_positive("sliding_window", sliding_window) if kind == "sliding" else None)
        return cls(len(windows), n_kv_heads, head_dim, tuple(windows))

    @classmethod
    def from_config(cls, path: str | os.PathLike[str]) -> ModelShape:
        """The KV shape a Hugging Face ``config.json`` describes (rules in ``docs/plan.md``)."""
        return _from_config(path)

    def full_attention(self) -> ModelShape:
        """Every layer at full length: what kvhal's ``KVCache`` (one block table for all layers) holds."""
        return replace(self, windows=(None,) * self.n_layers)

    def describe(self) -> str:
        sliding: dict[int, int] = {}
        for w in self.windows:
            if w is not None:
                sliding[w] = sliding.get(w, 0) + 1
        full = self.n_layers - sum(sliding.values())
        parts = [f"{full} full attention"] if full else []
        parts += [f"{c} sliding over {w:,} tokens" for w, c in sorted(sliding.items())]
        return f"{self.n_layers} layers ({', '.join(parts)}) x {self.n_kv_heads} KV heads x head_dim {self.head_dim}"


_LAYER_TYPES = {"full": "full", "full_attention": "full", "sliding": "sliding", "sliding_attention": "sliding"}
# transformers' defaults for configs that leave the pattern out: every Nth layer is full attention
_PATTERN_BY_MODEL_TYPE = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6}


def _from_config(path: str | os.PathLike[str]) -> ModelShape:
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"a config path is a str or path, got {path!r}")
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"cannot read {path}: {e.strerror}; pass the path of a Hugging Face config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not JSON ({e}); pass a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{path} holds a JSON {type(cfg).__name__}, not the object of a config.json")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal configs (Gemma 3, Mistral 3) nest the language model

    def field(key: str, required: bool = True, minimum: int = 1) -> int | None:
        value = cfg.get(key)
        if value is None:  # absent, or null
            if required:
                raise PlanError(f"{path}: {key} is missing; kvhal plan needs it (or pass the shape with flags)")
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise PlanError(f"{path}: {key} must be an int >= {minimum}, got {value!r}")
        return value

    n_layers = field("num_hidden_layers")
    assert n_layers is not None
    n_heads = field("num_attention_heads", required=False)
    n_kv = field("num_key_value_heads", required=False) or n_heads
    if n_kv is None:
        raise PlanError(f"{path}: needs num_key_value_heads or num_attention_heads")
    head_dim = field("head_dim", required=False)
    if head_dim is None:
        hidden = field("hidden_size")
        assert hidden is not None
        if n_heads is None or hidden % n_heads:
            raise PlanError(f"{path}: no head_dim, and hidden_size {hidden} is not a multiple of num_attention_heads")
        head_dim = hidden // n_heads
    use = cfg.get("use_sliding_window")
    if use is not None and not isinstance(use, bool):
        raise PlanError(f"{path}: use_sliding_window must be true or false, got {use!r}")
    window = field("sliding_window", required=False)
    source = f"{path}"
    types = cfg.get("layer_types")
    if use is False or ("max_window_layers" in cfg and use is not True):
        window = types = None  # Qwen2: the window is off unless use_sliding_window (its default is false)
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers:
            raise PlanError(f"{path}: layer_types must list one type per layer ({n_layers})")
        return replace(ModelShape.from_layer_types(n_kv, head_dim, types, window), source=source)
    windows: tuple[int | None, ...] = (None,) * n_layers
    if window is not None:
        first = field("max_window_layers", required=False, minimum=0)
        pattern = field("sliding_window_pattern", required=False) or _PATTERN_BY_MODEL_TYPE.get(
            str(cfg.get("model_type"))
        )
        if first is not None:  # Qwen2: layers from max_window_layers on slide
            windows = tuple(window if i >= first else None for i in range(n_layers))
        elif pattern is not None:  # Gemma 2/3, gpt-oss: layer i is full when (i + 1) % pattern == 0
            windows = tuple(None if (i + 1) % pattern == 0 else window for i in range(n_layers))
        else:  # Mistral: every layer slides
            windows = (window,) * n_layers
    return ModelShape(n_layers, n_kv, head_dim, windows, source)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "kib": 2**10,
    "mb": 10**6,
    "mib": 2**20,
    "gb": 10**9,
    "gib": 2**30,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(value: str | int) -> int:
    """``24GiB``, ``80GB``, ``512MiB``, ``1.5TiB`` or a plain count of bytes (rounded down to a whole byte)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PlanError(f"a memory budget is a str such as '24GiB' or an int of bytes, got {value!r}")
    if isinstance(value, int):
        return _positive("a memory budget", value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise PlanError(f"memory budget {value!r}: expected a number and a unit, such as 24GiB, 80GB or 512MiB")
    n = int(Fraction(m.group(1)) * unit)
    if n < 1:
        raise PlanError(f"memory budget {value!r} is less than one byte")
    return n


def _format_pair(item: Any) -> tuple[str, str]:
    """``"q8_0"`` (K and V), ``"q8_0/q4_0"`` (K/V) or a (k, v) tuple; names checked against the registry."""
    if isinstance(item, str):
        k, _, v = item.partition("/")
        pair = (k, v or k)
    elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item):
        pair = item
    else:
        raise PlanError(f"a format is a name such as 'q8_0', a K/V pair 'q8_0/q4_0' or a (k, v) tuple, got {item!r}")
    return formats.get(pair[0]).name, formats.get(pair[1]).name  # FormatError names the known ones


@dataclass(frozen=True)
class Decode:
    device: str
    ms_per_token: float
    tokens_per_s: float


@dataclass(frozen=True)
class FormatPlan:
    k_format: str
    v_format: str
    bytes_per_token: int  # K+V of one token over every layer (CacheSpec.bytes_per_token)
    bytes_per_token_past_windows: int  # what a token adds once every window is full: full-attention layers only
    page_bytes: int  # one layer's page of block_size tokens, K and V
    max_context: int | None  # longest context one sequence fits in the budget, page-rounded (None: no budget)
    unbounded: bool  # every layer slides and the windows fit: any context fits
    context: int | None  # what the figures below are at: the given context, else max_context (the window if unbounded)
    seq_bytes: int | None  # KV bytes one sequence holds at `context`, page-rounded
    max_seqs: int | None  # sequences of `context` tokens the budget holds
    read_bytes: int | None  # KV bytes one decode step of one sequence reads at `context`
    decode: tuple[Decode, ...]

    @property
    def label(self) -> str:
        return self.k_format if self.k_format == self.v_format else f"{self.k_format}/{self.v_format}"


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    block_size: int
    budget: int | None
    context: int | None
    devices: tuple[Device, ...]
    rows: tuple[FormatPlan, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pages(shape: ModelShape, full_pages: int, block_size: int) -> int:
    """Pages one sequence holds over all layers when a full-attention layer holds ``full_pages``."""
    return sum(full_pages if w is None else min(full_pages, -(-(w - 1) // block_size) + 1) for w in shape.windows)


def _steady(shape: ModelShape, block_size: int) -> int:
    """The context from which every sliding layer holds and reads its most: its window at the worst alignment."""
    return max(-(-(w - 1) // block_size) * block_size + 1 for w in shape.windows if w is not None)


def _seq_bytes(shape: ModelShape, spec: CacheSpec, context: int) -> int:
    """KV bytes one sequence of ``context`` tokens holds, page-rounded (windows at their worst alignment)."""
    page = spec.page_nbytes("k") + spec.page_nbytes("v")  # spec: one layer
    return _pages(shape, -(-context // spec.block_size), spec.block_size) * page


def _read_bytes(shape: ModelShape, spec: CacheSpec, context: int) -> int:
    """KV bytes one decode step reads: every stored token of a full layer, the window of a sliding one."""
    return sum(context if w is None else min(context, w) for w in shape.windows) * spec.bytes_per_token


def _max_context(shape: ModelShape, spec: CacheSpec, budget: int) -> int | None:
    """The longest context one sequence fits in ``budget`` bytes, a whole number of pages; None: any fits."""
    page, bs = spec.page_nbytes("k") + spec.page_nbytes("v"), spec.block_size
    n_full = shape.windows.count(None)
    caps = [-(-(w - 1) // bs) + 1 for w in shape.windows if w is not None]
    if not n_full and _pages(shape, max(caps), bs) * page <= budget:
        return None
    lo, hi = 0, (budget // (page * n_full) + 1 if n_full else max(caps))  # cost(hi) > budget
    while hi - lo > 1:  # the most pages per full layer that fit (cost grows with the pages)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _pages(shape, mid, bs) * page <= budget else (lo, mid)
    return lo * bs


def estimate(
    shape: ModelShape,
    formats_: Sequence[str | tuple[str, str]] | None = None,
    *,
    budget: str | int | None = None,
    context: int | None = None,
    block_size: int = 16,
    devices: Sequence[str] = (),
) -> Plan:
    """The plan for each format (default: every block format, K = V); see the module doc for the model."""
    if not isinstance(shape, ModelShape):
        raise PlanError(f"shape must be a kvhal.tools.plan.ModelShape, got {type(shape).__name__}")
    if formats_ is None:  # kltq (a K format with side data) only when named, as kltq:B/<V format>
        formats_ = formats.plain_names()
    if isinstance(formats_, str) or not isinstance(formats_, Sequence) or not formats_:
        raise PlanError(f"formats must be a non-empty list such as ['q8_0', 'q8_0/q4_0'], got {formats_!r}")
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise PlanError(f"devices must be a list of names such as ['h100', 'this'], got {devices!r}")
    pairs = [_format_pair(f) for f in formats_]
    budget_b = None if budget is None else parse_bytes(budget)
    if context is not None:
        _positive("context", context)
    _positive("block_size", block_size)
    devs = tuple(device(d) for d in devices)
    rows = []
    for k, v in pairs:
        spec = CacheSpec(1, shape.n_kv_heads, shape.head_dim, k, v, block_size)  # one layer; SpecError on a misfit
        n_max = _max_context(shape, spec, budget_b) if budget_b is not None else None
        unbounded = budget_b is not None and n_max is None
        at = context or n_max or (_steady(shape, block_size) if unbounded else None)
        sb = _seq_bytes(shape, spec, at) if at else None
        rb = _read_bytes(shape, spec, at) if at else None
        rows.append(
            FormatPlan(
                k_format=k,
                v_format=v,
                bytes_per_token=spec.bytes_per_token * shape.n_layers,
                bytes_per_token_past_windows=spec.bytes_per_token * shape.windows.count(None),
                page_bytes=spec.page_nbytes("k") + spec.page_nbytes("v"),
                max_context=n_max,
                unbounded=unbounded,
                context=at,
                seq_bytes=sb,
                max_seqs=budget_b // sb if budget_b is not None and sb else None,
                read_bytes=rb,
                decode=tuple(
                    Decode(d.name, rb / d.read_bytes_per_s * 1e3, d.read_bytes_per_s / rb) for d in devs if rb
                ),
            )
        )
    return Plan(shape, block_size, budget_b, context, devs, tuple(rows))


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.4g}"


def _rate(bps: float) -> str:
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e12 else f"{bps / 1e9:.1f} GB/s"


def text(p: Plan) -> str:
    sliding = any(w is not None for w in p.shape.windows)
    lines = [f"model: {p.shape.describe()}; block_size {p.block_size} (from {p.shape.source})"]
    if sliding:
        lines.append(
            "  sliding layers hold only the pages that cover their window (an engine with per-layer-group pages); "
            "kvhal's KVCache keeps every layer at full length: --full-attention gives its figures"
        )
    if p.context is not None:
        fit = f", sequences that fit in {_size(p.budget)} ({p.budget:,} bytes)" if p.budget is not None else ""
        lines.append(f"at context {p.context:,}: KV per sequence (page-rounded){fit}")
    elif p.budget is not None:
        lines.append(
            f"budget {_size(p.budget)} ({p.budget:,} bytes): max context of one sequence (whole pages), "
            "KV per sequence and decode at that context"
        )
    if p.devices:
        lines.append("decode: one sequence's K+V read once per token at the read bandwidth (KV only: a lower bound)")
        lines += [f"  {d.name:<8} {_rate(d.read_bytes_per_s):>11}  {d.label}; source: {d.source}" for d in p.devices]
    table: list[list[str]] = []
    for r in p.rows:
        row = {"K/V format": r.label, "bytes/token": f"{r.bytes_per_token:,}"}
        if sliding:
            row["past windows"] = f"{r.bytes_per_token_past_windows:,}"
        if p.budget is not None and p.context is None:
            row["max context"] = "no limit" if r.unbounded else f"{r.max_context:,}"
        if r.seq_bytes is not None:
            row["KV/sequence"] = _size(r.seq_bytes)
        if p.context is not None and r.max_seqs is not None:
            row["sequences"] = f"{r.max_seqs:,}"
        for d in r.decode:
            row[f"{d.device} ms/token"] = _num(d.ms_per_token)
            row[f"{d.device} tokens/s"] = _num(d.tokens_per_s)
        if not table:
            table.append(list(row))
        table.append(list(row.values()))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines.append("")
    for line in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    if p.context is None and any(r.unbounded for r in p.rows):
        at = _steady(p.shape, p.block_size)
        lines.append(
            f"(no limit: every layer slides; KV per sequence and decode are the same at any context from {at:,})"
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    pp = sub.add_parser("plan", help="bytes per token, max context or sequences in a memory budget, decode time")
    pp.add_argument("--config", help="a Hugging Face config.json (instead of --layers/--kv-heads/--head-dim)")
    pp.add_argument("--layers", type=int)
    pp.add_argument("--kv-heads", type=int)
    pp.add_argument("--head-dim", type=int)
    pp.add_argument("--sliding-window", type=int, help="window of the sliding layers, in tokens")
    pp.add_argument("--sliding-layers", type=int, help="how many layers slide (default: all, with --sliding-window)")
    pp.add_argument("--layer-types", help="per layer, comma list of sliding|full (with --sliding-window)")
    pp.add_argument("--full-attention", action="store_true", help="every layer at full length (kvhal's KVCache)")
    pp.add_argument(
        "--format", action="append", dest="formats", help="K=V format, or K/V pair such as q8_0/q4_0 (repeatable)"
    )
    pp.add_argument("--block-size", type=int, default=16, help="tokens per page (default 16)")
    pp.add_argument("--budget", help="memory for the KV cache, such as 24GiB, 80GB or 512MiB")
    pp.add_argument("--context", type=int, help="report sequences that fit at this context (default: max context)")
    pp.add_argument(
        "--device", action="append", dest="devices", default=[], help=f"{', '.join([*DEVICES, THIS])} (repeatable)"
    )
    pp.add_argument("--json", action="store_true", help="print JSON instead of a table")


def cli(args: argparse.Namespace) -> int:
    flags = (args.layers, args.kv_heads, args.head_dim)
    if args.config is not None:
        if any(f is not None for f in (*flags, args.sliding_window, args.sliding_layers, args.layer_types)):
            raise PlanError("pass either --config or the shape flags (--layers --kv-heads --head-dim ...), not both")
        shape = ModelShape.from_config(args.config)
    elif any(f is None for f in flags):
        raise PlanError("pass a model: --config path/to/config.json, or --layers N --kv-heads N --head-dim N")
    elif args.layer_types is not None:
        if args.sliding_layers is not None:
            raise PlanError("pass either --layer-types or --sliding-layers, not both")
        types = [t.strip() for t in args.layer_types.split(",")]
        shape = ModelShape.from_layer_types(args.kv_heads, args.head_dim, types, args.sliding_window)
        if shape.n_layers != args.layers:
            raise PlanError(f"--layer-types names {shape.n_layers} layers, --layers says {args.layers}")
    else:
        shape = ModelShape.uniform(args.layers, args.kv_heads, args.head_dim, args.sliding_window, args.sliding_layers)
    if args.full_attention:
        shape = shape.full_attention()
    p = estimate(
        shape, args.formats, budget=args.budget, context=args.context, block_size=args.block_size, devices=args.devices
    )
    print(json.dumps(p.as_dict(), indent=2) if args.json else text(p))
    return 0
