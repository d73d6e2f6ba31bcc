"""Prefill through torch's ``scaled_dot_product_attention``: the route cuda and rocm take for sequences of more
than one query (the backend's ``prefill`` option, default "sdpa").

Each prefill sequence's visible K/V pages are dequantized to bf16 in one bandwidth-bound pass (the backend's
``kvhal_load_bf16`` kernel), handed to torch through DLPack without a copy, and attended by SDPA, which runs
FlashAttention / cuDNN / memory-efficient kernels on the GPU: kernels tuned on the hardware, where kvhal's own
prefill kernel was tuned blind. torch is an optional extra of the GPU wheels (``pip install kvhal-cuda[torch]``);
without it a prefill call is refused with that line (``supports``), never run another way.

Nothing here touches a device API: it takes torch tensors, so the tests run it on torch's CPU device against
float64 attention, and RocmBackend (the same CudaBackend on HIP) shares it unchanged.
"""

from __future__ import annotations

from typing import Any

from kvhal.errors import UnsupportedError

EXTRA = "torch"  # kvhal-cuda's optional dependency group of this route
INSTALL = f"pip install 'kvhal-cuda[{EXTRA}]' (torch with CUDA or ROCm)"
# max |error| for unit-scale inputs against float64: q, K and V rounded to bf16 (8 significant bits) before SDPA's
# f32 accumulation. test_cuda_sdpa measures 0.7e-2 to 2.9e-2 over its formats (the worst: q8_0, a 12-token window,
# one K channel at 8x the others)
TOLERANCE = 5e-2
MIN_TORCH = (2, 5)  # SDPA's enable_gqa


def torch_missing() -> str | None:
    """Why the route cannot run here (torch is not installed, or older than MIN_TORCH), else None; cheap: finds
    torch and reads its version, imports nothing."""
    import importlib.metadata
    import importlib.util
    import re

    if importlib.util.find_spec("torch") is None:
        return f"prefill runs through torch SDPA and torch is not installed: {INSTALL}"
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # a torch without metadata (a source checkout): taken as it is
        return None
    # an older torch raised a raw TypeError (enable_gqa) on every prefill call
    if (m := re.match(r"(\d+)\.(\d+)", version)) and (int(m[1]), int(m[2])) < MIN_TORCH:
        return f"prefill runs through torch SDPA, which needs torch >= 2.5 (enable_gqa), not torch {version}: {INSTALL}"
    return None


def import_torch() -> Any:
    why = torch_missing()
    if why is not None:
        raise UnsupportedError(why + "; or create the cache with backend_options={'prefill': 'kernel'}")
    import torch

    return torch


def from_device(torch: Any, x: Any) -> Any:
    """``torch.from_dlpack(x)`` of a device array; a torch that cannot take it (a CPU-only build, as pip installs on
    Windows: AssertionError "Torch not compiled with CUDA enabled"; CUDA torch on ROCm) is an UnsupportedError."""
    try:
        return torch.from_dlpack(x)
    except Exception as e:
        raise UnsupportedError(
            f"prefill runs through torch SDPA and torch {torch.__version__} cannot take this GPU's arrays "
            f"({type(e).__name__}: {e}): {INSTALL}; or create the cache with backend_options={{'prefill': 'kernel'}}"
        ) from e


def visible_span(seq_len: int, q_len: int, causal: bool, window: int | None) -> tuple[int, int]:
    """KV positions ``[lo, hi)`` that any of a sequence's ``q_len`` last queries sees: what is dequantized for it."""
    first_q = seq_len - q_len
    lo = max(0, first_q - window + 1) if window is not None else 0
    return lo, seq_len


def attend(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    *,
    kv_start: int,
    seq_len: int,
    scale: float,
    causal: bool,
    window: int | None,
) -> Any:
    """One sequence's attention output ``[q_len, n_heads, D]`` in q's dtype (the caller widens it).

    ``q [q_len, n_heads, D]``: the queries at positions ``seq_len - q_len ..``; ``k``/``v`` ``[n, n_kv_heads, D]``:
    KV positions ``[kv_start, seq_len)`` in q's dtype. GQA goes to SDPA as ``enable_gqa`` (K/V are never repeated);
    causal without a window is torch's lower-right ``CausalBias`` (FlashAttention runs it), a window a boolean mask."""
    import torch.nn.functional as F

    q_len, n_heads, _ = q.shape
    n, n_kv_heads, _ = k.shape
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, D]
    mask: Any = None
    if window is not None:
        pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        j = torch.arange(kv_start, seq_len, device=q.device)[None, :]
        mask = j > pos - window
        if causal:
            mask &= j <= pos
    elif causal and q_len > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q_len, n)  # query i sees keys <= n - q_len + i (n == q_len: plain causal)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=n_heads != n_kv_heads)
    return out[0].transpose(0, 1)
