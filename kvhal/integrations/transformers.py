"""Hugging Face transformers on a kvhal cache: ``KVHalCache`` and ``attn_implementation="kvhal"``.

    from kvhal.integrations.transformers import KVHalCache      # registers attn_implementation="kvhal"
    model.set_attn_implementation("kvhal")
    cache = KVHalCache.from_model(model, k_format="q8_0", v_format="q8_0", capacity_tokens=8192, backend="cpu")
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)

Under ``attn_implementation="sdpa"`` or ``"eager"`` the same cache works too (for a user who forgot to
switch): ``update`` stores every new column and returns each row's whole history from ``KVCache.load``,
dense, in the model's dtype, and transformers' own attention runs over it with its own mask. That reads
every cached token back per layer and step, and stores padding columns like any other: correct, slower,
and without kvhal's fused attention; ``"kvhal"`` is the mode to run.

Batch row ``b`` is kvhal sequence ``cache.seqs[b]`` and holds that row's real tokens only: a position the
attention mask marks as padding is never stored or attended, and its attention output is zero. kvhal
sequences are dense, so ``get_seq_length`` counts columns (padding included, as transformers does) while
each sequence counts its own tokens; RoPE positions come from the model (``position_ids``), so dense
storage changes nothing in the keys.

How the pieces meet: the model calls ``cache.update(k, v, layer)`` and then the attention function with
that layer's queries, in the same thread. Only the attention function sees the padding mask, so ``update``
keeps the new K/V (no concatenation, no dense history) and names itself in a context variable; the
attention function stores the real rows and runs ``KVCache.attention`` over the quantized pages.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Backend
from ..cache import KVCache
from ..errors import CacheMismatchError, DTypeError, KVHalError, PositionError, ShapeError, SpecError, UnsupportedError
from ..eviction import (
    EvictionResult,
    EvictOnFull,
    ExpectedAttention,
    OnEvict,
    Policy,
    SnapKV,
    check_press,
    expected_queries,
)
from ..fingerprint import Fingerprint
from ..interop import to_like
from ..spec import CacheSpec
from ..validate import attention_options, is_int, token_ids
from ..validate import layer as validate_layer
from .versions import need_transformers, require_transformers

_found = require_transformers()
try:
    import torch
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:
    raise need_transformers(_found, str(e)) from e

ATTN_IMPLEMENTATION = "kvhal"
# transformers' own attention functions a KVHalCache also serves, with dense K/V from KVCache.load
DENSE_IMPLEMENTATIONS = ("sdpa", "eager")
_LOAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what KVCache.load writes into a CPU tensor

# (cache, layer, the key tensor its update returned, the value tensor): set by update, taken by the attention
_PENDING: ContextVar[tuple[KVHalCache, int, torch.Tensor, torch.Tensor] | None] = ContextVar(
    "kvhal_pending_update", default=None
)


def _same_mask(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())


@dataclass
class _Step:
    """The columns one forward adds: which of them are real, per row (``None``: all of them, every row)."""

    mask: Any
    first_col: int
    n_cols: int
    rows: list[np.ndarray] | None


class KVHalLayer(CacheLayerMixin):  # type: ignore[misc]
    """One model layer's view of the shared ``KVCache`` (transformers inspects ``cache.layers``)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: KVHalCache, layer: int, window: int | None) -> None:
        super().__init__()
        self.owner, self.layer, self.sliding_window = owner, layer, window
        self.is_sliding = window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.owner.update(key_states, value_states, self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.layer)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length(self.layer)

    def get_max_length(self) -> int:
        return -1


class KVHalCache(Cache):  # type: ignore[misc]
    """A transformers ``Cache`` whose layers all store into one kvhal ``KVCache`` (``self.kv``).

    Run the model with ``attn_implementation="kvhal"``: attention reads the quantized pages directly. Under
    ``"sdpa"`` or ``"eager"`` (a cache from ``from_model``) it hands transformers dense K/V from ``load``.
    Sliding-window layers attend over their window but keep every token (pages are shared by all layers
    of a sequence), so ``crop`` is always exact.

    ``press`` and ``keep`` compress the prefill as kvpress's pipeline does: the first forward pass after the
    cache was empty (``generate``'s prefill) attends with ``observe=True`` where the policy needs scores, and
    after its last layer each row is evicted to ``int(keep * its tokens)`` positions chosen by ``press``
    (the results are in ``self.evictions``). Later tokens keep their original positions (RoPE comes from
    the model's ``position_ids``), exactly as kvpress's compressed ``DynamicCache``. A ``KVCache`` whose
    ``on_full`` is ``EvictOnFull`` with a scoring policy observes every forward pass, so decode steps that
    find the cache full evict with scores. The press runs after the first forward pass only: with transformers'
    chunked prefill (``prefill_chunk_size``) that is the first chunk, so prefill in one pass with a press.
    """

    def __init__(
        self,
        kv: KVCache,
        windows: Sequence[int | None],
        *,
        press: Policy | None = None,
        keep: float | None = None,
        config: Any = None,
    ) -> None:
        """``config``: the model's text config (``from_model`` passes it), whose attention implementation is read
        at each update; without it the cache serves ``attn_implementation="kvhal"`` only."""
        if not isinstance(kv, KVCache):
            raise SpecError(f"kv must be a kvhal.KVCache, got {type(kv).__name__}; or use KVHalCache.from_model")
        press, keep = check_press(press, keep, kv.observe_window, kv.spec, kv.backend)
        n_layers = kv.spec.n_layers
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence) or len(windows) != n_layers:
            raise SpecError(f"windows must list one sliding window (int) or None per layer, {n_layers} in all")
        for i, w in enumerate(windows):
            if w is not None and (not is_int(w) or w < 1):
                raise SpecError(
                    f"windows[{i}] is {w!r}; a sliding window is a positive int, or None for full attention"
                )
        super().__init__(layers=[KVHalLayer(self, i, w) for i, w in enumerate(windows)])
        self.kv = kv
        self.windows: list[int | None] = [None if w is None else int(w) for w in windows]
        self.seqs: list[int] = []  # batch row -> kvhal sequence
        self._real = np.zeros((0, 0), bool)  # [rows, columns]: which columns of each row are stored tokens
        self._cols = [0] * n_layers  # columns each layer has attended (they differ inside a forward)
        self._step: _Step | None = None
        self._failed: str | None = None
        self._config = config  # its attention implementation is read per update: sdpa/eager get dense K/V
        self._checked_config: Any = None  # the last model config whose layers matched the cache's
        if config is not None:
            self._check_model(config)
        self.press, self.keep = press, keep
        self.evictions: list[EvictionResult] = []  # what the press dropped from each row, in row order
        self._pressed_cols: int | None = None  # columns at the press (None: the prefill is still to come)
        on_full = kv.on_full
        self._observe_always = isinstance(on_full, EvictOnFull) and on_full.policy.needs_scores
        # ExpectedAttention: the RoPE its query statistics undo and carry on, and per row, per layer, those statistics
        scorer = getattr(press, "press", press)
        self._expected = scorer if isinstance(scorer, ExpectedAttention) else None
        self._rope = None if self._expected is None else rope_of(config, kv.spec.head_dim)
        self._queries: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []

    @classmethod
    def from_model(
        cls,
        model: Any,
        *,
        capacity_tokens: int,
        k_format: str = "q8_0",
        v_format: str = "q8_0",
        backend: str | Backend = "auto",
        allow_fallback: bool = False,
        backend_options: dict[str, Any] | None = None,
        fingerprint: Fingerprint | None = None,
        press: Policy | None = None,
        keep: float | None = None,
        observe_window: int | None = None,
        on_full: str | EvictOnFull = "prefix_lru",
        on_evict: OnEvict | None = None,
        **spec_options: Any,
    ) -> KVHalCache:
        """A cache shaped by ``model``'s config: its layers, KV heads (GQA), head_dim and sliding windows.

        ``capacity_tokens`` is the whole cache (all rows, all beams); ``spec_options`` go to ``CacheSpec``
        (e.g. ``block_size``, ``tail``). The model runs ``attn_implementation="kvhal"`` (attention over the
        quantized pages) or ``"sdpa"``/``"eager"`` (transformers' attention over K/V dense from ``load``; no
        press there). ``fingerprint`` names
        the model for the prefix cache (default: its class, name and config; pass one with the weights' digest
        before sharing blocks through tiers or snapshots).

        Eviction: ``press`` (``SinkWindow``, ``Knorm``, ``H2O``, ``SnapKV``, ``ExpectedAttention``, ``AdaKV``) with
        ``keep`` (the fraction of each row's prefill kept, in (0, 1]) compresses the prefill (see the class;
        ``ExpectedAttention`` takes its query statistics from the prefill's queries, its RoPE from the config). ``observe_window`` (default: the
        ``SnapKV`` press's window, else 32), ``on_full`` and ``on_evict`` go to ``KVCache``.
        """
        if not isinstance(model, PreTrainedModel):
            raise SpecError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        spec_fields = {f.name for f in dataclasses.fields(CacheSpec) if f.init} - {
            "n_layers", "n_kv_heads", "head_dim", "k_format", "v_format"
        }  # fmt: skip
        unknown = sorted(set(spec_options) - spec_fields)
        if unknown:
            raise SpecError(
                f"KVHalCache.from_model got unknown keyword(s) {unknown}; it takes capacity_tokens, k_format, "
                "v_format, backend, allow_fallback, backend_options, fingerprint, press, keep, observe_window, "
                f"on_full, on_evict and CacheSpec's {sorted(spec_fields)}"
            )
        if observe_window is None:
            scorers = (getattr(press, "press", press), getattr(on_full, "policy", None))  # AdaKV wraps its scorer
            snap = [p for p in scorers if isinstance(p, SnapKV)]
            observe_window = snap[0].window if snap else 32
        config = model.config.get_text_config(decoder=True)
        _check_implementation(getattr(config, "_attn_implementation", None))
        n_heads = config.num_attention_heads
        n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        windows: list[int | None] = []
        for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                windows.append(kwargs["sliding_window"])
            else:
                raise UnsupportedError(
                    f"layer {i} is {kind!r}; KVHalCache holds full and sliding-window attention layers only"
                )
        spec = CacheSpec(
            n_layers=len(windows),
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            k_format=k_format,
            v_format=v_format,
            **spec_options,
        )
        if fingerprint is None:
            digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()
            name = f"{type(model).__name__}:{getattr(model.config, '_name_or_path', '')}"
            fingerprint = Fingerprint(model=name, extra={"config_sha256": digest})
        kv = KVCache(
            spec,
            capacity_tokens,
            backend,
            allow_fallback=allow_fallback,
            backend_options=backend_options,
            fingerprint=fingerprint,
            on_full=on_full,
            on_evict=on_evict,
            observe_window=observe_window,
        )
        return cls(kv, windows, press=press, keep=keep, config=config)

    def match_prefix(self, input_ids: Any, attention_mask: Any = None) -> list[int]:
        """Before ``generate``: give each row the longest cached prefix of its prompt, and record the
        prompt's token ids so its blocks become matchable. Returns the tokens reused per row.

        ``generate(input_ids, past_key_values=cache)`` then computes only the columns past the reused
        ones (the same count for every row: the fewest any row reuses, padding included). Call it on an
        empty cache (a new one, or after ``reset()``, which keeps the freed blocks matchable)."""
        if self.seqs:
            raise KVHalError("match_prefix needs an empty cache: call reset() first (freed blocks stay matchable)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ShapeError(f"input_ids must be a 2D torch tensor [batch, columns], got {type(input_ids).__name__}")
        batch, cols = (int(x) for x in input_ids.shape)
        if batch < 1 or cols < 1:
            raise ShapeError(
                f"input_ids has shape {(batch, cols)}; match_prefix needs at least one row and one column (the "
                "prompt generate will run)"
            )
        if attention_mask is None:
            real = np.ones((batch, cols), bool)
        elif isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == (batch, cols):
            real = attention_mask.detach().to("cpu", torch.bool).numpy()
        else:
            raise ShapeError(f"attention_mask must be a torch tensor of input_ids' shape {(batch, cols)} or None")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ShapeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        ids = input_ids.detach().to("cpu").numpy()
        # every row checked before the first kv.match_prefix: a refused row leaves no sequence behind
        rows = [token_ids(ids[r][real[r]]) for r in range(batch)]
        if any(not np.all(real[r][np.argmax(real[r]) :]) for r in range(batch) if real[r].any()):
            raise UnsupportedError("match_prefix takes left padding only (padding before every real token)")
        matched: list[tuple[int, int]] = []
        try:
            for row in rows:
                matched.append(self.kv.match_prefix(row))
            pads = [cols - len(row) for row in rows]
            reused = min(pad + n for pad, (_, n) in zip(pads, matched))  # columns every row holds
            reused = min(reused, cols - 1)  # generate computes at least the last column
            out = []
            for (seq, n), pad, row in zip(matched, pads, rows):
                keep = max(0, reused - pad)
                if n > keep:
                    self.kv.seq_rm(seq, keep, -1)
                self.kv.append_tokens(seq, row[keep:])  # the ids of the positions generate will store
                out.append(keep)
        except BaseException:
            for seq, _ in matched:  # not yet rows of this cache: reset() could not free them
                self.kv.free_seq(seq)
            raise
        self.seqs = [seq for seq, _ in matched]
        self._real = real[:, :reused].copy()
        self._cols = [reused] * len(self._cols)
        return out

    # -- the Cache interface ----------------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold this layer's new K/V ``[batch, n_kv_heads, n_new, head_dim]`` for the kvhal attention function.

        Returns them as they are (the new tokens only): the attention function stores the real ones.
        """
        if self._failed is not None:
            raise KVHalError(f"{self._failed}; the cache's layers are out of step: call reset() and start over")
        if not is_int(layer_idx) or not 0 <= layer_idx < len(self._cols):
            raise PositionError(
                f"layer_idx {layer_idx!r} is out of range; the cache has layers 0..{len(self._cols) - 1}"
            )
        layer = int(layer_idx)
        if self._cols[layer] == max(self._cols) != min(self._cols):  # a new forward pass, yet a layer lags behind
            raise SpecError(self._layers_lagging())
        pending = _PENDING.get()
        if pending is not None and pending[0] is self:
            _PENDING.set(None)
            raise KVHalError(
                f"layer {pending[1]}'s attention did not run through attn_implementation="
                f'"{ATTN_IMPLEMENTATION}"; call model.set_attn_implementation("{ATTN_IMPLEMENTATION}")'
            )
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                raise ShapeError(f"{name} must be a 4D tensor [batch, n_kv_heads, n_new, head_dim], got {x!r:.80}")
        if key_states.shape != value_states.shape:
            raise ShapeError(
                f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} differ"
            )
        _check_dtypes(key_states=key_states, value_states=value_states)
        spec = self.kv.spec
        if key_states.shape[1] != spec.n_kv_heads or key_states.shape[3] != spec.head_dim:
            raise ShapeError(
                f"key_states has shape {tuple(key_states.shape)}; the cache holds {spec.n_kv_heads} KV heads of "
                f"head_dim {spec.head_dim}: build it from this model with KVHalCache.from_model"
            )
        batch = int(key_states.shape[0])
        if self.seqs and batch != len(self.seqs):
            raise ShapeError(
                f"the cache holds {len(self.seqs)} rows but this step has {batch}; call reset() for a new batch"
            )
        if self._config is not None:
            impl = getattr(self._config, "_attn_implementation", None)
            if impl != ATTN_IMPLEMENTATION:
                _check_implementation(impl)
                return self._dense(layer, key_states, value_states)
        _PENDING.set((self, layer, key_states, value_states))
        return key_states, value_states

    def _dense(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' own attention (sdpa, eager): store every new column, return each row's whole history
        ``[batch, n_kv_heads, columns, head_dim]`` from ``load``, in the model's dtype."""
        if self.press is not None or self._observe_always:
            raise UnsupportedError(
                "a press, or on_full=EvictOnFull with a scoring policy, needs the attention scores that only kvhal "
                f'attention observes: call model.set_attn_implementation("{ATTN_IMPLEMENTATION}")'
            )
        if not self._real.all():
            raise UnsupportedError(
                "this cache holds rows with padding left out (stored under kvhal attention or match_prefix), which "
                'transformers\' dense attention cannot line up with its mask: call model.set_attn_implementation("kvhal")'
                " or reset() the cache"
            )
        batch, n_new = int(key_states.shape[0]), int(key_states.shape[2])
        kv = self.kv
        try:
            self._plan(layer, None, batch, n_new)
            k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [batch, n_new, n_kv_heads, head_dim]
            for b, s in enumerate(self.seqs):
                kv.store(s, layer, k[b], v[b])
            if key_states.device.type == "cpu" and key_states.dtype in _LOAD_DTYPES:
                # straight into the model's dtype, in one buffer for the batch (no f32 copy, no stack)
                shape = (batch, self._cols[layer] + n_new, *k.shape[2:])
                bk = torch.empty(shape, dtype=key_states.dtype)
                bv = torch.empty(shape, dtype=value_states.dtype)
                for b, s in enumerate(self.seqs):
                    kv.load(s, layer, out=(bk[b], bv[b]))
                dense_k, dense_v = bk.transpose(1, 2), bv.transpose(1, 2)
            else:
                ks, vs = [], []
                for s in self.seqs:
                    kb, vb = kv.load(s, layer)
                    ks.append(to_like(kb, key_states))
                    vs.append(to_like(vb, value_states))
                dense_k = torch.stack(ks).transpose(1, 2).to(key_states.dtype)
                dense_v = torch.stack(vs).transpose(1, 2).to(value_states.dtype)
        except BaseException as e:
            if self._real.shape[1] != self._cols[layer]:  # this forward already changed the cache
                self._failed = f"layer {layer} failed in the middle of a forward pass ({type(e).__name__}: {e})"
            raise
        self._cols[layer] += n_new
        return dense_k, dense_v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns seen (padding included), as transformers counts positions. Layer indices work as on
        transformers' ``DynamicCache``: a negative one counts from the last layer, one past the last gives 0."""
        if not is_int(layer_idx):
            raise PositionError(f"layer_idx must be an int, got {type(layer_idx).__name__} {layer_idx!r}")
        n = len(self._cols)
        if layer_idx < -n:
            raise PositionError(f"layer_idx {layer_idx} is out of range; the cache has layers 0..{n - 1} (or -{n}..-1)")
        return self._cols[layer_idx] if layer_idx < n else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if not is_int(query_length) or query_length < 0:
            raise ShapeError(f"query_length must be an int >= 0, got {type(query_length).__name__} {query_length!r}")
        return self.get_seq_length(layer_idx) + int(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.seqs else -1

    def reset(self) -> None:
        """Free every row's sequence; the cache is empty and takes a new batch."""
        pending = _PENDING.get()
        if pending is not None and pending[0] is self:
            _PENDING.set(None)
        for s in self.seqs:
            self.kv.free_seq(s)
        self.seqs = []
        self._real = np.zeros((0, 0), bool)
        self._cols = [0] * len(self._cols)
        self._step = None
        self._failed = None
        self.evictions = []
        self._pressed_cols = None
        self._queries = []

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` columns (transformers' convention: a negative count)."""
        if not is_int(tokens_to_remove) or tokens_to_remove > 0:
            raise PositionError(f"crop takes a negative int, the count of tokens to remove; got {tokens_to_remove!r}")
        n = -int(tokens_to_remove)
        if n == 0:
            return
        self._in_step("crop")
        cols = self._real.shape[1]
        if n > cols:
            raise PositionError(f"crop removes {n} tokens but the cache holds {cols}")
        if self._pressed_cols is not None and cols - n < self._pressed_cols:
            raise PositionError(
                f"crop to {cols - n} columns reaches into the prefill the press compressed ({self._pressed_cols} "
                "columns): its dropped tokens are gone; crop at most the tokens stored after it, or reset()"
            )
        for s, real in zip(self.seqs, self._real):
            drop = int(real[cols - n :].sum())
            if drop:
                self.kv.seq_rm(s, self.kv.seq_len(s) - drop, -1)
        self._real = self._real[:, : cols - n]
        self._cols = [cols - n] * len(self._cols)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search): shared pages, copy-on-write."""
        self._select(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not is_int(repeats) or repeats < 1:
            raise ShapeError(f"repeats must be a positive int, got {repeats!r}")
        self._select([b for b in range(len(self.seqs)) for _ in range(int(repeats))], "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices, "indices")

    # -- internals ------------------------------------------------------------------------------------

    def _in_step(self, what: str) -> None:
        if len(set(self._cols)) != 1 or _PENDING.get() is not None:
            raise KVHalError(
                f"{what} between the layers of a forward pass; call it between forward passes"
                + ("" if _PENDING.get() is not None else f" ({self._layers_lagging()})")
            )

    def _layers_lagging(self) -> str:
        top = max(self._cols)
        ran = [i for i, c in enumerate(self._cols) if c == top]
        return (
            f"the last forward pass updated {len(ran)} of the cache's {len(self._cols)} layers (layers {ran}): a "
            f"model of {len(ran)} layers needs a cache of {len(ran)} (build it with KVHalCache.from_model), and a "
            "forward pass that stopped midway needs reset()"
        )

    def _check_model(self, config: Any) -> None:
        """Refuse a model whose layers (from its text config, as ``from_model`` reads them) are not the cache's:
        another count, or a layer whose sliding window (None: full attention) differs from the cache's, which
        kvhal attention would apply to that layer (a model may window through its mask alone, without telling
        the attention function)."""
        checked = config
        try:
            if hasattr(config, "get_text_config"):
                config = config.get_text_config(decoder=True)
            kinds, kwargs = get_layer_types_and_kwargs(config)
        except Exception:  # not a transformers config (a stand-in): nothing to compare
            return
        if len(kwargs) != len(self._cols):
            raise SpecError(
                f"the model has {len(kwargs)} attention layers but the cache has {len(self._cols)}: build the cache "
                "with one window per model layer (KVHalCache.from_model(model, ...) does)"
            )
        for i, (kind, kw) in enumerate(zip(kinds, kwargs)):
            if kind not in ("full_attention", "sliding_attention"):
                continue  # not a layer from_model builds a window for
            window = kw.get("sliding_window") if kind == "sliding_attention" else None
            if window != self.windows[i]:
                raise SpecError(
                    f"layer {i} of the model is {kind} (sliding_window={window}) but the cache was built with "
                    f"{self.windows[i]}: build it from this model with KVHalCache.from_model"
                )
        self._checked_config = checked

    def _select(self, idx: Any, what: str) -> None:
        """Rows become ``old[idx[0]], old[idx[1]], ...``: each old row's first use keeps its sequence, later
        uses are ``seq_cp`` copies (whole pages shared), and unused rows are freed."""
        if isinstance(idx, torch.Tensor):
            if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.ndim != 1:
                raise ShapeError(f"{what} must be a 1D integer tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
            idx = idx.tolist()
        if not isinstance(idx, list) or not all(is_int(i) and 0 <= i < len(self.seqs) for i in idx):
            raise ShapeError(f"{what} must hold row indices in [0, {len(self.seqs)}), got {idx!r:.80}")
        if not self.seqs:
            return
        if not idx:
            raise ShapeError(
                f"{what} is empty but the cache holds {len(self.seqs)} rows: keep at least one row, or call reset() "
                "to drop them all"
            )
        self._in_step(what)
        old, kept, new, copies = self.seqs, set(), [], []
        try:
            # seq_cp of a whole sequence shares pages (it allocates none) but may be refused: a sequence an
            # AdaKV press compacted per head is not copied
            for i in idx:
                if i in kept:
                    copies.append(self.kv.seq_cp(old[i]))
                    new.append(copies[-1])
                else:
                    new.append(old[i])
                    kept.add(i)
        except BaseException:
            for s in copies:  # the copies made before the refusal: the rows stay as they were
                self.kv.free_seq(s)
            raise
        for i, s in enumerate(old):
            if i not in kept:
                self.kv.free_seq(s)
        self.seqs = new
        self._real = self._real[idx]

    def _plan(self, layer: int, mask: Any, batch: int, n_new: int) -> _Step:
        """Which of this forward's ``n_new`` columns are real, per row; taken from the padding mask the first
        time a layer sees these columns, then reused by the other layers."""
        first = self._cols[layer]
        step = self._step
        if step is not None and step.first_col == first and step.n_cols == n_new:
            if mask is step.mask or _same_mask(mask, step.mask):  # models build one mask per layer kind
                return step
            raise KVHalError(f"layer {layer} got another padding mask than the layers before it in this forward pass")
        width = self._real.shape[1]
        if first != width:
            raise KVHalError(
                f"layer {layer} is at column {first} but the cache at {width}: a forward pass ran a subset of layers"
            )
        if mask is None:
            new_real = np.ones((batch, n_new), bool)
        else:
            if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
                raise UnsupportedError(
                    "the kvhal attention takes the 2D padding mask [batch, columns] (or None); got "
                    f"{type(mask).__name__}{'' if not hasattr(mask, 'shape') else tuple(mask.shape)}: a 4D or "
                    "custom mask cannot be mapped onto kvhal's dense sequences"
                )
            if tuple(mask.shape) != (batch, first + n_new):
                raise ShapeError(
                    f"attention mask has shape {tuple(mask.shape)}; expected [{batch}, {first + n_new}] "
                    f"({first} cached columns + {n_new} new)"
                )
            m = mask.detach().to("cpu", torch.bool).numpy()
            if first and not np.array_equal(m[:, :first], self._real):
                raise PositionError(
                    "the attention mask changes which cached positions are real; kvhal stores only real tokens "
                    "and cannot mask (or unmask) a cached one: reset() and run the whole sequence again"
                )
            new_real = m[:, first:]
        if not self.seqs:
            self.seqs = [self.kv.new_seq() for _ in range(batch)]
            self._real = np.zeros((batch, 0), bool)
        self._real = np.concatenate([self._real, new_real], axis=1)
        rows = None if new_real.all() else [np.flatnonzero(r) for r in new_real]
        self._step = _Step(mask, first, n_new, rows)
        return self._step

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scale: float
    ) -> torch.Tensor:
        """Store this step's new ``key``/``value`` columns of ``layer`` and attend with ``query`` over the cache:
        what ``attn_implementation="kvhal"`` runs for each layer (``[batch, heads, tokens, head_dim]`` tensors)."""
        # every argument checked before _plan changes anything: a refused call leaves the cache as it was
        layer = validate_layer(layer, len(self._cols))
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                got = f"{type(x).__name__} of shape {tuple(x.shape)}" if hasattr(x, "shape") else repr(x)[:80]
                raise ShapeError(f"{name} must be a 4D torch tensor [batch, heads, n_new, head_dim], got {got}")
        _check_dtypes(query=query, key=key, value=value)
        spec = self.kv.spec
        batch, n_heads, n_new, head_dim = (int(n) for n in query.shape)
        if key.shape != value.shape or tuple(key.shape) != (batch, spec.n_kv_heads, n_new, spec.head_dim):
            raise ShapeError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [{batch}, {spec.n_kv_heads}, "
                f"{n_new}, {spec.head_dim}] (query's batch and tokens, the cache's KV heads and head_dim)"
            )
        if head_dim != spec.head_dim or n_heads == 0 or n_heads % spec.n_kv_heads:
            raise ShapeError(
                f"query has shape {tuple(query.shape)}; expected head_dim {spec.head_dim} and a head count that is a "
                f"positive multiple of the cache's {spec.n_kv_heads} KV heads"
            )
        if batch < 1 or n_new < 1:
            raise ShapeError(f"query has shape {tuple(query.shape)}; attend needs at least one row and one token")
        if self.seqs and batch != len(self.seqs):
            raise ShapeError(
                f"the cache holds {len(self.seqs)} rows but this step has {batch}; call reset() for a new batch"
            )
        scale, _ = attention_options(scale, True, None, False, head_dim)
        window = self.windows[layer]
        kv = self.kv
        pressing = self.press is not None and self._pressed_cols is None
        observe = self._observe_always or (pressing and self.press is not None and self.press.needs_scores)
        try:
            step = self._plan(layer, mask, batch, n_new)
            if step.rows is None:  # every new column real (decode, unpadded prefill)
                k, v = key.transpose(1, 2), value.transpose(1, 2)  # [batch, n_new, n_kv_heads, head_dim]
                for b, s in enumerate(self.seqs):
                    kv.store(s, layer, k[b], v[b])
                q = query.transpose(1, 2).reshape(batch * n_new, n_heads, head_dim)
                o = kv.attention(
                    layer, q, seqs=self.seqs, q_lens=[n_new] * batch, scale=scale, window=window, observe=observe
                )
                out = to_like(o, query).view(batch, n_new, n_heads, head_dim)
                if pressing and self._expected is not None:
                    for b, s in enumerate(self.seqs):
                        self._note_queries(b, s, layer, q[b * n_new : (b + 1) * n_new])
            else:
                out = query.new_zeros((batch, n_new, n_heads, head_dim), dtype=torch.float32)
                seqs, lens, picks, qs = [], [], [], []
                for b, (s, cols) in enumerate(zip(self.seqs, step.rows)):
                    if len(cols) == 0:
                        continue
                    pick = torch.from_numpy(cols).to(query.device)
                    kv.store(s, layer, key[b, :, pick].transpose(0, 1), value[b, :, pick].transpose(0, 1))
                    seqs.append(s)
                    lens.append(len(cols))
                    picks.append((b, pick))
                    qs.append(query[b, :, pick].transpose(0, 1))
                if seqs:
                    o = to_like(
                        kv.attention(
                            layer, torch.cat(qs), seqs=seqs, q_lens=lens, scale=scale, window=window, observe=observe
                        ),
                        query,
                    )
                    for (b, pick), part in zip(picks, o.split(lens)):
                        out[b, pick] = part
                    if pressing and self._expected is not None:
                        for s, (b, _), rows in zip(seqs, picks, qs):
                            self._note_queries(b, s, layer, rows)
            if pressing and layer == len(self._cols) - 1:
                self._compress()
        except BaseException as e:
            if self._real.shape[1] != self._cols[layer]:  # this forward already changed the cache
                self._failed = f"layer {layer} failed in the middle of a forward pass ({type(e).__name__}: {e})"
            raise
        self._cols[layer] += n_new
        return out.to(query.dtype)

    def _note_queries(self, b: int, seq: int, layer: int, q: torch.Tensor) -> None:
        """ExpectedAttention: the statistics of row ``b``'s queries at ``layer`` (``[n, n_heads, head_dim]``, after
        RoPE; they are the sequence's last ``n`` positions)."""
        assert self._expected is not None and self._rope is not None
        while len(self._queries) <= b:
            self._queries.append({})
        n, end = q.shape[0], self.kv.seq_len(seq, layer)
        x = q.detach().to(device="cpu", dtype=torch.float64).numpy()
        e = self._expected
        self._queries[b][layer] = expected_queries(x, np.arange(end - n, end), *self._rope, e.n_sink, e.n_future)

    def _compress(self) -> None:
        """After the prefill's last layer: evict every row to ``int(keep * its tokens)`` with the press."""
        assert self.press is not None and self.keep is not None
        results = []
        for b, s in enumerate(self.seqs):
            n = self.kv.seq_len(s)
            press = self.press
            if self._expected is not None:
                stats = self._queries[b] if b < len(self._queries) else {}
                press = press.with_queries([stats[layer] for layer in range(len(self._cols)) if layer in stats])
            results.append(self.kv.evict(s, press, int(n * self.keep)))
        self.evictions = results
        self._pressed_cols = self._real.shape[1]
        self._queries = []


def rope_of(config: Any, head_dim: int) -> tuple[np.ndarray, float]:
    """The model's RoPE from its config: the frequencies ``[head_dim / 2]`` and the factor on cos and sin, as
    transformers' rotary embedding computes them (``rope_parameters``: its ``rope_type`` through
    ``ROPE_INIT_FUNCTIONS``, "default" from ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None)
    if config is None or not isinstance(params, dict) or "rope_theta" not in params:
        raise SpecError(
            "press=ExpectedAttention needs the model's RoPE (rope_parameters with rope_theta in its config): "
            "build the cache with KVHalCache.from_model(model, ...)"
        )
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (float(params["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        scale = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if kind not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedError(f"press=ExpectedAttention does not know rope_type {kind!r}")
        freq, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        inv_freq = freq.double().numpy()
    if inv_freq.shape != (head_dim // 2,):
        raise UnsupportedError(
            f"press=ExpectedAttention takes RoPE over every channel (head_dim {head_dim}); this model rotates "
            f"{2 * len(inv_freq)} of them"
        )
    return inv_freq, float(scale)


def kvhal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``attn_implementation="kvhal"`` function: store this layer's real new tokens, then attend over
    the quantized pages. ``query`` is ``[batch, n_heads, n_new, head_dim]``; returns ``[batch, n_new, n_heads, head_dim]``."""
    pending = _PENDING.get()
    if pending is None:
        raise CacheMismatchError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" needs a KVHalCache (this forward pass has another cache, '
            "or none): pass cache=KVHalCache.from_model(model, ...) to generate() or to the forward call, or run "
            'this cache with model.set_attn_implementation("sdpa")'
        )
    if pending[2] is not key:
        _PENDING.set(None)
        raise UnsupportedError(
            f"layer {pending[1]}'s attention got other key states than KVHalCache.update returned: this model "
            "changes K/V after the cache update, which kvhal attention cannot follow; use another attn_implementation"
        )
    _PENDING.set(None)
    cache, layer = pending[0], pending[1]
    config = getattr(module, "config", None)
    if config is not None and config is not cache._checked_config:
        cache._check_model(config)  # a cache built without config, or run by another model than its own
    if dropout:
        raise UnsupportedError(f"kvhal attention has no dropout (got {dropout}); run the model in eval() mode")
    for name in ("softcap", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedError(f"kvhal attention does not implement {name}; use another attn_implementation")
    if hasattr(module, "sinks") or not getattr(module, "is_causal", True):
        raise UnsupportedError("kvhal attention is causal attention without sinks; this module needs another kind")
    window = kwargs.get("sliding_window")
    if window is not None and window != cache.windows[layer]:
        raise SpecError(
            f"layer {layer} attends with sliding_window={window} but the cache was built with "
            f"{cache.windows[layer]}; build it from this model with KVHalCache.from_model"
        )
    scale = float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5
    return cache.attend(layer, query, key, value, attention_mask, scale), None


def _check_dtypes(**tensors: torch.Tensor) -> None:
    """The dtypes kvhal stores and attends with, refused before any state changes."""
    for name, x in tensors.items():
        if x.dtype not in _LOAD_DTYPES:
            raise DTypeError(
                f"{name} has dtype {x.dtype}; kvhal takes float32, float16 or bfloat16: run the model in one of "
                "them (model.float(), .half() or .bfloat16())"
            )


def _check_implementation(impl: Any) -> None:
    if impl != ATTN_IMPLEMENTATION and impl not in DENSE_IMPLEMENTATIONS:
        raise SpecError(
            f"the model runs attn_implementation={impl!r}; a KVHalCache runs under "
            f'"{ATTN_IMPLEMENTATION}" (attention over the quantized pages: call '
            f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}")) or {" or ".join(map(repr, DENSE_IMPLEMENTATIONS))}'
        )


def kvhal_mask(*, attention_mask: Any = None, allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    """Mask creation for ``attn_implementation="kvhal"``: kvhal applies causality and windows itself, so the
    model passes on the 2D padding mask alone. Masks beyond causal, window and padding (packed sequences,
    bidirectional blocks, extra mask functions) are refused rather than ignored."""
    if not allow_is_causal_skip:
        raise UnsupportedError(
            "this model asks for an attention mask beyond causal + sliding window + padding, which kvhal "
            "attention does not implement; use another attn_implementation"
        )
    return attention_mask


AttentionInterface.register(ATTN_IMPLEMENTATION, kvhal_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kvhal_mask)
