"""WGSL sources: the templates under kernels/, filled in per pool geometry and format. Pure strings, no device.

Block lengths and sizes come from kvhal's format registry (``backend_util.format_table()``) as one
generated constant block prepended to every shader, so no .wgsl file repeats them. A format runs here
when kernels/formats/<name>.wgsl gives its three sections (``deq``, ``dot``, ``quant``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from string import Template

from kvhal.backend_util import format_table

KERNELS = resources.files(__package__).joinpath("kernels")
FORMATS = frozenset(name for name, *_ in format_table() if KERNELS.joinpath("formats", f"{name}.wgsl").is_file())
_quant_lens = {length for name, _, length, _ in format_table() if name in FORMATS and length > 1}
if len(_quant_lens) != 1:  # store units, q sums and the dot loops assume one shared block length
    raise ImportError(f"kvhal_vulkan: quantized formats with block lengths {sorted(_quant_lens)}; the shaders take one")
QK = _quant_lens.pop()  # values per quantized block; store also quantizes float rows in units of QK values
WORKGROUP = 64  # invocations per workgroup of every kernel (WebGPU guarantees 256)


def kernel_text(name: str) -> str:
    return KERNELS.joinpath(name).read_text()


@functools.cache
def prelude() -> str:
    """The format constants, then kernels/common.wgsl: the start of every shader."""
    lines = ["// generated from kvhal.backend_util.format_table()"]
    for name, _, length, nbytes in format_table():
        if name in FORMATS:
            lines += [f"const {name.upper()}_LEN: u32 = {length}u;", f"const {name.upper()}_BYTES: u32 = {nbytes}u;"]
    lines += [f"const QK: u32 = {QK}u;", f"const WG: u32 = {WORKGROUP}u;  // invocations per workgroup"]
    return "\n".join(lines) + "\n" + kernel_text("common.wgsl")


@dataclass(frozen=True)
class PoolGeometry:
    """What a kernel needs of one pool: its format and the layout of its chunks (one binding each)."""

    fmt: str
    heads: int
    block_size: int
    row_bytes: int
    pages_per_chunk: int
    chunks: int

    def consts(self) -> dict[str, int]:
        return {"H": self.heads, "BS": self.block_size, "PPC": self.pages_per_chunk, "RB": self.row_bytes}


@dataclass(frozen=True)
class Kernel:
    """A complete shader and the kinds of its storage bindings 1.. ("read" or "rw"; binding 0 is the uniform)."""

    source: str
    bindings: tuple[str, ...]


@functools.cache
def _format_section(fmt: str, section: str, prefix: str) -> str:
    parts: dict[str, list[str]] = {}
    current = ""
    for line in kernel_text(f"formats/{fmt}.wgsl").splitlines():
        if line.startswith("//! "):
            current = line[4:].strip()
            continue
        parts.setdefault(current, []).append(line)
    return Template("\n".join(parts[section])).substitute(P=prefix)


def _pool_access(prefix: str, n: int, first: int, mode: str) -> str:
    """Bindings for a pool split into ``n`` chunks, and accessors that pick the chunk ``c``.

    ``mode`` "read": word/half/byte readers; "atomic": atomic store/and/or (writers of rows that
    share their boundary words with rows other invocations write).
    """
    elem = "atomic<u32>" if mode == "atomic" else "u32"
    access = "read_write" if mode == "atomic" else "read"
    lines = [f"@group(0) @binding({first + i}) var<storage, {access}> {prefix}{i}: array<{elem}>;" for i in range(n)]

    def fn(head: str, stmt: str) -> None:
        if n == 1:
            body = stmt.format(i=0)
        else:
            cases = [f"case {i}u: {{ {stmt.format(i=i)} }}" for i in range(n - 1)]
            body = "switch c { " + " ".join(cases) + f" default: {{ {stmt.format(i=n - 1)} }} }}"
        lines.append(f"fn {prefix}_{head} {{ {body} }}")

    if mode == "atomic":
        fn("st(c: u32, w: u32, x: u32)", f"atomicStore(&{prefix}{{i}}[w], x);")
        fn("and(c: u32, w: u32, x: u32)", f"atomicAnd(&{prefix}{{i}}[w], x);")
        fn("or(c: u32, w: u32, x: u32)", f"atomicOr(&{prefix}{{i}}[w], x);")
        return "\n".join(lines)
    fn("rd(c: u32, w: u32) -> u32", f"return {prefix}{{i}}[w];")
    lines.append(f"""
fn {prefix}_h(c: u32, byte: u32) -> u32 {{ return ({prefix}_rd(c, byte >> 2u) >> ((byte & 2u) * 8u)) & 0xffffu; }}
fn {prefix}_b(c: u32, byte: u32) -> u32 {{ return ({prefix}_rd(c, byte >> 2u) >> ((byte & 3u) * 8u)) & 0xffu; }}
fn {prefix}_w(c: u32, byte: u32) -> u32 {{
    let i = byte >> 2u;
    let lo = {prefix}_rd(c, i);
    if ((byte & 2u) == 0u) {{ return lo; }}
    return (lo >> 16u) | ({prefix}_rd(c, i + 1u) << 16u);
}}""")
    return "\n".join(lines)


def _source(kernel: str, consts: dict[str, int], body: str) -> str:
    main = Template(kernel_text(kernel)).substitute({**{k: str(v) for k, v in consts.items()}, "FORMAT": body})
    return prelude() + "\n" + main


def store_unit_bytes(fmt: str) -> tuple[int, int]:
    """(bytes of one store unit, bytes per value): a unit is one block, or QK values of a float row."""
    (block_len, block_bytes) = next((n, b) for name, _, n, b in format_table() if name == fmt)
    per_value = block_bytes if block_len == 1 else 0
    return (QK * per_value if per_value else block_bytes), per_value


@functools.lru_cache(maxsize=256)
def store(g: PoolGeometry, head_dim: int) -> Kernel:
    unit, per_value = store_unit_bytes(g.fmt)
    consts = {**g.consts(), "D": head_dim, "UPR": -(-head_dim // QK), "UB": unit, "VB": per_value}
    body = _pool_access("p", g.chunks, 3, "atomic") + "\n" + _format_section(g.fmt, "quant", "p")
    return Kernel(_source("store.wgsl", consts, body), ("read", "read") + ("rw",) * g.chunks)


@functools.lru_cache(maxsize=256)
def load(g: PoolGeometry, head_dim: int) -> Kernel:
    body = _pool_access("p", g.chunks, 3, "read") + "\n" + _format_section(g.fmt, "deq", "p")
    return Kernel(_source("load.wgsl", {**g.consts(), "D": head_dim}, body), ("read", "rw") + ("read",) * g.chunks)


@functools.lru_cache(maxsize=256)
def gather(g: PoolGeometry) -> Kernel:
    """Rows of the given slots (bytes as stored) into word-aligned scratch rows ``[n, H, ceil(RB / 4)]``."""
    body = _pool_access("p", g.chunks, 3, "read")
    return Kernel(_source("gather.wgsl", g.consts(), body), ("read", "rw") + ("read",) * g.chunks)


@functools.lru_cache(maxsize=256)
def scatter(g: PoolGeometry) -> Kernel:
    """The inverse of ``gather``: word-aligned scratch rows into the given slots."""
    body = _pool_access("p", g.chunks, 3, "atomic")
    return Kernel(_source("scatter.wgsl", g.consts(), body), ("read", "read") + ("rw",) * g.chunks)


def attention_workgroup_bytes(head_dim: int, heads_per_tile: int) -> int:
    """Workgroup memory of attention.wgsl: qv, qbs, sc, pw, ms/ls/cs per head; vc, vr and three words."""
    per_head = head_dim + -(-head_dim // QK) + 2 * WORKGROUP + 3
    return 4 * (heads_per_tile * per_head + 2 * WORKGROUP + 3)


def heads_per_tile(group: int, head_dim: int, budget: int) -> int:
    """Query heads one attention workgroup serves: the largest divisor of the GQA group, up to 8, that fits
    ``budget`` bytes of workgroup memory (0 when not even one head fits)."""
    fits = [t for t in range(1, min(group, 8) + 1) if group % t == 0]
    return max((t for t in fits if attention_workgroup_bytes(head_dim, t) <= budget), default=0)


@functools.lru_cache(maxsize=256)
def attention(k: PoolGeometry, v: PoolGeometry, head_dim: int, ht: int) -> Kernel:
    consts = {
        "D": head_dim,
        "H": k.heads,
        "BS": k.block_size,
        "KPPC": k.pages_per_chunk,
        "VPPC": v.pages_per_chunk,
        "KRB": k.row_bytes,
        "VRB": v.row_bytes,
        "WG": WORKGROUP,
        "HT": ht,
    }
    body = "\n".join(
        [
            _pool_access("k", k.chunks, 4, "read"),
            _pool_access("v", v.chunks, 4 + k.chunks, "read"),
            _format_section(k.fmt, "dot", "k"),
            _format_section(v.fmt, "deq", "v"),
        ]
    )
    return Kernel(_source("attention.wgsl", consts, body), ("read", "read", "rw") + ("read",) * (k.chunks + v.chunks))


@functools.lru_cache(maxsize=64)
def combine(head_dim: int) -> Kernel:
    return Kernel(_source("combine.wgsl", {"D": head_dim}, ""), ("read", "rw"))
