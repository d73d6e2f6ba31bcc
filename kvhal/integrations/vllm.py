"""A vLLM V1 KV connector on kvhal's block tiers: vLLM's computed blocks saved in a kvhal format, keyed by
kvhal's chained block hashes, and loaded into vLLM's blocks on a prefix hit in any other vLLM process.

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model, enforce_eager=True, kv_transfer_config=KVTransferConfig(
        kv_connector="KVHalConnector", kv_connector_module_path="kvhal.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config={"disk_path": "/var/cache/kvhal", "format": "q8_0"}))

Config keys (``kv_connector_extra_config``, docs/design.md): ``disk_path`` (a ``DiskTier`` directory) with
``disk_max_bytes``, ``redis_url`` (a ``RedisTier``), ``host_max_bytes`` (a ``HostTier`` in this process),
``format`` (``"bf16"``: the values as a bf16 vLLM cache holds them; or any kvhal format such as ``"q8_0"`` or
``"fp8_e4m3"``), ``model_id`` (the model's name in the fingerprint; default vLLM's model name or path).

A block's payload is kvhal's raw block layout (docs/design.md) of ``CacheSpec(layers, kv heads, head_dim,
format, block_size=vLLM's)``, under ``BlockKey(Fingerprint(model_id, ...).digest(spec), hash)`` with the hash
chain of the prompt's token ids: the same key and bytes a ``kvhal.KVCache`` of that spec and fingerprint
writes, so the blocks are equal in every process and shared through Redis or a disk directory.

The scheduler side looks the prompt's full blocks up in the tiers (host, disk, Redis, in order), reads and
checks them (a torn, foreign or corrupt blob is a miss) and reports the hits to vLLM; the worker side writes
them into the blocks vLLM allocated, before the forward pass. After each step the worker saves the prompt's
newly computed full blocks. A failure of the store is a miss (counted in ``stats()``, logged once), never a
failed request. Importing this module imports vLLM; ``import kvhal`` does not import this module.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from .. import formats
from ..errors import KVHalError, SpecError, UnsupportedError
from ..fingerprint import Fingerprint, extra_digest, hash_chain
from ..spec import CacheSpec
from ..tiers import BlockKey, DiskTier, HostTier, RedisTier, Tier
from ..validate import is_int

__all__ = ["ConnectorConfig", "ConnectorStats", "KVHalConnector", "KVHalConnectorMetadata"]

log = logging.getLogger("kvhal.vllm")

DEFAULT_DISK_BYTES = 16 << 30
_KEYS = ("disk_path", "disk_max_bytes", "redis_url", "host_max_bytes", "format", "model_id")
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` checked: at least one tier, a known format."""

    disk_path: str | None = None
    disk_max_bytes: int = DEFAULT_DISK_BYTES
    redis_url: str | None = None
    host_max_bytes: int | None = None
    format: str = "bf16"
    model_id: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise SpecError(
                f"kv_connector_extra_config must be a dict such as {{'disk_path': '/var/cache/kvhal'}}, got "
                f"{type(extra).__name__}"
            )
        extra = dict(extra)
        unknown = sorted((k for k in extra if k not in _KEYS), key=repr)
        if unknown:
            raise SpecError(
                f"kv_connector_extra_config has unknown key(s) {unknown}; KVHalConnector takes {list(_KEYS)}"
            )
        for key in ("disk_path", "redis_url", "format", "model_id"):
            value = extra.get(key)
            if value is not None and not isinstance(value, str):
                raise SpecError(f"kv_connector_extra_config[{key!r}] must be a str, got {type(value).__name__}")
            if value == "":
                raise SpecError(f"kv_connector_extra_config[{key!r}] is an empty string; give a value or leave it out")
        sizes: dict[str, int] = {}
        for key in ("disk_max_bytes", "host_max_bytes"):
            value = extra.get(key)
            if value is not None:
                if not is_int(value) or value < 1:
                    raise SpecError(f"kv_connector_extra_config[{key!r}] must be a positive int (bytes), got {value!r}")
                sizes[key] = int(value)
        if "disk_max_bytes" in sizes and extra.get("disk_path") is None:
            raise SpecError(
                "kv_connector_extra_config sets disk_max_bytes but no disk_path; set disk_path (a directory) for "
                "the disk tier, or leave disk_max_bytes out"
            )
        cfg = cls(
            disk_path=extra.get("disk_path"),
            disk_max_bytes=sizes.get("disk_max_bytes", DEFAULT_DISK_BYTES),
            redis_url=extra.get("redis_url"),
            host_max_bytes=sizes.get("host_max_bytes"),
            format=extra.get("format") or "bf16",
            model_id=extra.get("model_id"),
        )
        if cfg.disk_path is None and cfg.redis_url is None and cfg.host_max_bytes is None:
            raise SpecError(
                "KVHalConnector needs a tier: set disk_path (a directory), redis_url ('redis://host:port') or "
                "host_max_bytes in kv_connector_extra_config"
            )
        fmt = formats.get(cfg.format)  # FormatError names the known formats
        if fmt.k_page is not None:
            raise UnsupportedError(
                f"format {cfg.format!r} quantizes K per channel over a page; KVHalConnector stores per-token "
                "formats: pick bf16, f16, q8_0, q4_0, q5_0, q5_1, q4_1, fp8_e4m3, fp8_e5m2, mxfp4 or nvfp4"
            )
        return cfg


@dataclass
class ConnectorStats:
    """Counters of this process's connector. ``errors``: failures of the store or of a block's bytes, each a
    miss (or a block not saved); ``last_error`` the latest one."""

    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    saved_payload_bytes: int = 0
    errors: int = 0
    last_error: str | None = None


class _Store:
    """The tiers of one config in one process, shared by the scheduler and worker sides (a lock makes the
    tiers, which are not thread-safe, safe to call from both)."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.tiers: list[Tier] = []
        if cfg.host_max_bytes is not None:
            self.tiers.append(HostTier(cfg.host_max_bytes))
        if cfg.disk_path is not None:
            self.tiers.append(DiskTier(cfg.disk_path, cfg.disk_max_bytes))
        if cfg.redis_url is not None:
            self.tiers.append(RedisTier(cfg.redis_url))
        self.lock = threading.Lock()
        self.stats = ConnectorStats()
        self._logged = False

    def error(self, what: str, exc: BaseException | str) -> None:
        msg = f"{what}: {exc if isinstance(exc, str) else f'{type(exc).__name__}: {exc}'}"
        self.stats.errors += 1
        self.stats.last_error = msg
        if not self._logged:  # once: a dead server would otherwise log every step
            self._logged = True
            log.warning("kvhal connector: %s (counted as a miss; later errors are counted, not logged)", msg)

    def tier_errors(self) -> None:
        for t in self.tiers:
            s = t.stats()
            if s.errors and not self._logged and s.last_error:
                self.error(type(t).__name__, s.last_error)

    def fetch(self, keys: Sequence[BlockKey], nbytes: int) -> list[bytes]:
        """The payloads of the longest run of ``keys`` from the first that the tiers hold, each checked
        (checksum and namespace by the tier, length here). Never raises: a failure ends the run."""
        out: list[bytes] = []
        with self.lock:
            try:
                for tier in self.tiers:
                    rest = list(keys[len(out) :])
                    if not rest:
                        break
                    n = tier.contains(rest)
                    if not n:
                        continue
                    for p in tier.get(rest[:n]):
                        if p is None or len(p) != nbytes:
                            if p is not None:
                                self.error("lookup", f"a block of {len(p)} bytes where {nbytes} belong")
                            break
                        out.append(bytes(p))
                self.tier_errors()
            except Exception as e:  # a tier is not supposed to raise: a miss all the same
                self.error("lookup", e)
        return out

    def held(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, every tier holds already (their saves are skipped)."""
        with self.lock:
            try:
                return min(t.contains(list(keys)) for t in self.tiers) if keys else 0
            except Exception as e:
                self.error("probe", e)
                return 0

    def put(self, keys: Sequence[BlockKey], payloads: Sequence[bytes | memoryview]) -> int:
        with self.lock:
            held = 0
            for tier in self.tiers:
                try:
                    held = max(held, sum(tier.put(list(keys), list(payloads))))
                except Exception as e:
                    self.error("save", e)
            self.tier_errors()
            return held


_STORES: dict[ConnectorConfig, _Store] = {}
_STORES_LOCK = threading.Lock()


def _store(cfg: ConnectorConfig) -> _Store:
    with _STORES_LOCK:
        if cfg not in _STORES:
            _STORES[cfg] = _Store(cfg)
        return _STORES[cfg]


@dataclass
class _Load:
    block_ids: list[int]
    payloads: list[bytes]


@dataclass
class _Save:
    block_ids: list[int]
    keys: list[BlockKey]


@dataclass
class KVHalConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the worker: blocks to fill from payloads, blocks to save under keys."""

    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


@dataclass
class _Req:
    keys: list[BlockKey]  # the prompt's full blocks
    block_ids: list[int]
    done: int  # blocks saved or known to be held


class KVHalConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's ``kv_connector="KVHalConnector"`` (``kv_connector_module_path="kvhal.integrations.vllm"``)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        # kv_role: "kv_both" saves and loads, "kv_producer" only saves, "kv_consumer" only loads
        self.saves = bool(self._kv_transfer_config.is_kv_producer)
        self.loads = bool(self._kv_transfer_config.is_kv_consumer)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise UnsupportedError(
                "KVHalConnector runs with tensor_parallel_size=1 and pipeline_parallel_size=1 (one worker holds "
                "every layer and head); run one engine per device instead"
            )
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            raise UnsupportedError(
                "KVHalConnector needs one KV cache group (a model whose attention layers share one block layout)"
            )
        group = kv_cache_config.kv_cache_groups[0]
        kspec = group.kv_cache_spec
        dtype = getattr(kspec, "dtype", None)
        head_size_v = getattr(kspec, "head_size_v", None) or getattr(kspec, "head_size", None)
        if dtype not in _DTYPES or head_size_v != kspec.head_size or type(kspec).__name__ != "FullAttentionSpec":
            raise UnsupportedError(
                f"KVHalConnector takes a full-attention KV cache of bf16, f16 or f32 with K and V of one head size; "
                f"this engine has {type(kspec).__name__} of {dtype} (an fp8 kv_cache_dtype: use 'auto')"
            )
        self.layer_names: list[str] = list(group.layer_names)
        self.block_size = int(kspec.block_size)
        self.dtype: torch.dtype = dtype
        self.spec = CacheSpec(
            n_layers=len(self.layer_names),
            n_kv_heads=int(kspec.num_kv_heads),
            head_dim=int(kspec.head_size),
            k_format=self.config.format,
            v_format=self.config.format,
            block_size=self.block_size,
        )
        model = vllm_config.model_config
        try:
            config_json = model.hf_config.to_json_string(use_diff=False)
        except Exception:  # a config that cannot say itself: its repr still names it
            config_json = repr(model.hf_config)
        self.fingerprint = Fingerprint(
            model=self.config.model_id or f"{model.model}@{model.revision or ''}",
            extra={
                "engine": "vllm",
                "model_dtype": str(model.dtype).replace("torch.", ""),
                "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
            },
        )
        self.namespace = self.fingerprint.digest(self.spec)
        self.store = _store(self.config)
        self._fmt = formats.get(self.config.format)
        self._row = self._fmt.row_bytes(self.spec.head_dim)
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        # request id -> (its prompt's keys, the first block looked up, the payloads found from it)
        self._found: dict[str, tuple[list[BlockKey], int, list[bytes]]] = {}
        self._loads: list[_Load] = []
        # worker side
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K, V views [blocks, heads, bs, D]
        self._load_errors: set[int] = set()

    # -- naming --------------------------------------------------------------------------------------------

    def block_keys(self, request: Any) -> list[BlockKey]:
        """The keys of the full blocks of ``request``'s prompt (its LoRA, cache salt and multimodal inputs in
        the extra digest)."""
        extra: dict[str, Any] = {}
        if getattr(request, "cache_salt", None):
            extra["cache_salt"] = str(request.cache_salt)
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            extra["lora"] = str(getattr(lora, "lora_name", lora))
        mm = getattr(request, "mm_features", None)
        if mm:
            extra["mm"] = [str(getattr(f, "identifier", f)) for f in mm]
        tokens = list(request.prompt_token_ids or [])
        chain = hash_chain(self.namespace, tokens, self.block_size, extra_digest(extra))
        return [BlockKey(self.namespace, h) for h in chain]

    def stats(self) -> ConnectorStats:
        """This process's counters (shared by every connector of the same config in it)."""
        return self.store.stats

    @property
    def bytes_per_token(self) -> float:
        """Payload bytes stored per token (all layers, K and V; each blob adds an 88-byte header per block)."""
        return self.spec.block_nbytes / self.block_size

    # -- scheduler side ------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            if not self.loads or getattr(request, "prompt_embeds", None) is not None:
                return 0, False
            n_prompt = len(request.prompt_token_ids or [])
            usable = (n_prompt - 1) // self.block_size  # the last token is always computed: its logits
            first = num_computed_tokens // self.block_size
            if usable <= first:
                return 0, False
            found = self._found.get(request.request_id)
            if found is None or found[1] != first:
                keys = self.block_keys(request)
                # the blocks after vLLM's own hits (a chain's key names its whole prefix: no need to read those)
                payloads = self.store.fetch(keys[first:usable], self.spec.block_nbytes)
                self.store.stats.lookups += 1
                self.store.stats.hit_blocks += len(payloads)
                self.store.stats.miss_blocks += usable - first - len(payloads)
                found = (keys, first, payloads)
                self._found[request.request_id] = found
            return len(found[2]) * self.block_size, False
        except Exception as e:  # never fail a request for the store
            self.store.error("lookup", e)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        found = self._found.pop(rid, None)
        if rid not in self._reqs and getattr(request, "prompt_embeds", None) is None:
            try:  # the prompt's keys, for its saves
                self._reqs[rid] = _Req(found[0] if found else self.block_keys(request), [], 0)
            except Exception as e:
                self.store.error("save", e)
        if not num_external_tokens or found is None:
            return
        _, first, payloads = found
        n = -(-num_external_tokens // self.block_size)
        ids = list(blocks.get_block_ids()[0])
        start = first + len(payloads) - n
        if start < first or len(ids) < first + len(payloads):
            self.store.error("load", f"vLLM asked for {num_external_tokens} tokens the lookup did not find")
            return
        self._loads.append(_Load(ids[start : first + len(payloads)], payloads[start - first :]))

    def build_connector_meta(self, scheduler_output: Any) -> KVHalConnectorMetadata:
        meta = KVHalConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is None:
                continue
            req.block_ids = list(new.block_ids[0])
            self._plan_save(meta, req, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self._reqs.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    req.block_ids = list(new_ids[0])
                else:
                    req.block_ids.extend(new_ids[0])
            self._plan_save(meta, req, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return meta

    def _plan_save(self, meta: KVHalConnectorMetadata, req: _Req, computed: int) -> None:
        if not self.saves:
            return
        full = min(computed // self.block_size, len(req.keys), len(req.block_ids))
        if full <= req.done:
            return
        if req.done == 0:  # blocks every tier holds already (another process's prefill) are not saved again
            req.done = min(self.store.held(req.keys[:full]), full)
        if full > req.done:
            meta.saves.append(_Save(req.block_ids[req.done : full], req.keys[req.done : full]))
            req.done = full

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec = self.spec
        views: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in self.layer_names:
            if name not in kv_caches:
                raise UnsupportedError(f"vLLM registered no KV cache for layer {name!r}; KVHalConnector needs each")
            views.append(_block_views(kv_caches[name], spec.n_kv_heads, spec.block_size, spec.head_dim, name))
        self._kv = views

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVHalConnectorMetadata):
            return
        for load in meta.loads:
            try:
                self._write_blocks(load.block_ids, load.payloads)
                self.store.stats.loaded_blocks += len(load.block_ids)
            except Exception as e:
                self.store.error("load", e)
                self._load_errors.update(load.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved after the step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVHalConnectorMetadata) or not meta.saves:
            return
        for save in meta.saves:
            try:
                payloads = self._read_blocks(save.block_ids)
            except Exception as e:
                self.store.error("save", e)
                continue
            held = self.store.put(save.keys, [memoryview(row) for row in payloads])
            self.store.stats.saved_blocks += held
            self.store.stats.saved_payload_bytes += held * self.spec.block_nbytes

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- bytes ---------------------------------------------------------------------------------------------

    def _read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """``uint8 [n, block_nbytes]``: kvhal's raw block layout of vLLM's blocks in the connector's format."""
        n = len(block_ids)
        out = np.empty((n, self.spec.block_nbytes), np.uint8)
        idx = torch.as_tensor(block_ids, dtype=torch.long)
        page = self.spec.n_kv_heads * self.block_size * self._row
        off = 0
        for k, v in self._kv:
            for x in (k, v):
                rows = x.index_select(0, idx.to(x.device)).to("cpu", torch.float32).numpy()
                out[:, off : off + page] = self._fmt.quantize(rows).reshape(n, page)
                off += page
        return out

    def _write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        n = len(block_ids)
        if len(payloads) != n:
            raise KVHalError(f"{len(payloads)} payloads for {n} blocks")
        data = np.frombuffer(b"".join(payloads), np.uint8).reshape(n, self.spec.block_nbytes)
        spec = self.spec
        shape = (n, spec.n_kv_heads, spec.block_size, self._row)
        page = spec.n_kv_heads * spec.block_size * self._row
        off = 0
        for k, v in self._kv:
            idx = torch.as_tensor(block_ids, dtype=torch.long, device=k.device)
            for x in (k, v):
                rows = self._fmt.dequantize(data[:, off : off + page].reshape(shape))
                x[idx] = torch.from_numpy(rows).to(x.device, x.dtype)  # x is a view: writes vLLM's blocks
                off += page


def _block_views(t: torch.Tensor, heads: int, bs: int, dim: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's vLLM cache as views ``[blocks, heads, block_size, head_dim]``.

    vLLM's CPU attention: ``[blocks, heads, block_size, 2 * head_dim]``, each (block, head) holding its K page
    then its V page (``view(blocks, heads, 2 * block_size, head_dim)``, then split). The flash-attention
    layouts ``[2, blocks, block_size, heads, head_dim]`` (NHD) and ``[2, blocks, heads, block_size, head_dim]``
    (HND) are taken too (checked by shape; tested on CPU only)."""
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[1:] == (heads, bs, 2 * dim):
        v4 = t.view(shape[0], heads, 2 * bs, dim)
        return v4[:, :, :bs], v4[:, :, bs:]
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (heads, bs, dim):
        return t[0], t[1]
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, heads, dim):
        return t[0].transpose(1, 2), t[1].transpose(1, 2)
    raise UnsupportedError(
        f"layer {name!r}: vLLM's KV cache has shape {shape}, a layout KVHalConnector does not know "
        f"(it takes [blocks, {heads}, {bs}, {2 * dim}] and [2, blocks, {heads}|{bs}, {bs}|{heads}, {dim}])"
    )
