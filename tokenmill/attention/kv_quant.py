"""Quantized KV caches: FP8 (kv_cache_dtype fp8 / fp8_e4m3, per-layer scales) and INT8 (int8, a scale per token
and KV head): the pool's dtype, the start-up checks, and where the fp8 scales came from. The arithmetic itself is
kernels.kv_fp8 / kernels.kv_int8 (torch) and the Triton kernels (in registers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.kv_fp8 import FP8_DTYPE, is_fp8
from tokenmill.kernels.kv_int8 import INT8_DTYPE, is_int8

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype (validated there) as the pool's torch dtype."""
    return {"auto": model_dtype, "int8": INT8_DTYPE}.get(name, FP8_DTYPE)


def check_kv_cache_dtype(kv_dtype: torch.dtype, device: torch.device, backend_name: str,
                         has_latent_attention: bool = False) -> None:
    """Refuse at start-up what cannot run: Triton converts to and from e4m3 only on compute capability 8.9+; the
    latent (MLA) cache's kernels read per-layer scales only, not int8's per-row ones."""
    if is_int8(kv_dtype) and has_latent_attention:
        raise ValueError("kv_cache_dtype 'int8' does not support latent attention (MLA) caches: use kv_cache_dtype "
                         "'fp8' or 'auto'")
    if (is_fp8(kv_dtype) or is_int8(kv_dtype)) and device.type == "cpu":
        logger.warning("KV cache in %s on the CPU: the C attention kernel reads 16/32-bit pools only, so attention "
                       "takes the torch path (2-5x slower steps); use it where memory, not speed, is short",
                       str(kv_dtype).removeprefix("torch."))
    if not is_fp8(kv_dtype) or device.type != "cuda" or backend_name != "triton":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or newer for the Triton "
                         f"attention kernels (this one is {capability[0]}.{capability[1]}): use kv_cache_dtype "
                         f"'auto', or attention_backend 'torch'")


def log_kv_scales(layers: Sequence[Attention]) -> None:
    """Say where the scales came from: without calibrated ones, 1.0 may cost accuracy."""
    calibrated = sum(bool(layer.k_scale != 1.0 or layer.v_scale != 1.0) for layer in layers)
    if calibrated:
        logger.info("FP8 KV cache: %d of %d attention layers have checkpoint k/v scales", calibrated, len(layers))
    else:
        logger.warning("FP8 KV cache without k_scale / v_scale in the checkpoint: using 1.0, which may cost "
                       "accuracy where K or V leave the e4m3 range (±448) or are very small")
