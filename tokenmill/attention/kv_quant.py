"""FP8 KV cache (kv_cache_dtype fp8 / fp8_e4m3): the pool's dtype, the start-up check, and where the scales
came from. The arithmetic itself is kernels.kv_fp8 (torch) and the Triton kernels (in registers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.kv_fp8 import FP8_DTYPE, is_fp8

if TYPE_CHECKING:
    from tokenmill.layers.attention import Attention

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """CacheConfig.kv_cache_dtype (validated there) as the pool's torch dtype."""
    return model_dtype if name == "auto" else FP8_DTYPE


def check_kv_cache_dtype(kv_dtype: torch.dtype, device: torch.device, backend_name: str) -> None:
    """Refuse at start-up what cannot run: Triton converts to and from e4m3 only on compute capability 8.9+."""
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
