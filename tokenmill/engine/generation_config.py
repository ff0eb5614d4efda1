"""generation_config.json's sampling defaults (vLLM's generation_config and override_generation_config): one
reading for the server's requests and the offline LLM's."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
"""Where a Hugging Face model folder keeps its default sampling parameters."""
READ_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""The keys read (from the file and the override) -> the sampling parameter each sets, as vLLM reads them;
do_sample and the rest are not read."""


def generation_config_file(setting: str, model: str | None) -> str | None:
    """The generation_config.json that `setting` ('auto' | 'vllm' | a folder) names: None for 'vllm', or where
    'auto' finds none (a GGUF file, a folder without one, no model yet); a folder without one is a ValueError."""
    if setting == "vllm" or (setting == "auto" and model is None):
        return None
    path = os.path.join(model if setting == "auto" else setting, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        return path
    if setting == "auto":
        return None
    raise ValueError(f"generation_config: no {GENERATION_CONFIG_FILE} in {setting!r}; pass a folder that holds "
                     f"one, 'auto' (the model's) or 'vllm' (none)")


def _as_params(config: Mapping[str, Any], source: str, remedy: str = "") -> dict[str, Any]:
    """The read keys of `config` as sampling parameters (None: unset), checked as SamplingParams checks them."""
    params = {READ_KEYS[key]: value for key, value in config.items() if key in READ_KEYS and value is not None}
    try:
        SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}{remedy}") from None
    return params


def check_override(override: Any) -> None:
    """override_generation_config: a JSON object whose read keys make valid sampling parameters (said at start-up,
    before the model loads)."""
    if not isinstance(override, Mapping):
        raise ValueError(f"override_generation_config must be a JSON object such as '{{\"temperature\": 0.5}}', "
                         f"got {override!r}")
    _as_params(override, "override_generation_config")


def sampling_defaults(setting: str, model: str | None, override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The sampling parameters' defaults for requests that leave them unset (max_tokens also limits every server
    request): the file `setting` names, then `override` on top of it (its None values unset the file's), as vLLM
    merges them; {} for 'vllm' without an override."""
    path = generation_config_file(setting, model)
    config: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the default sampling parameters of {path}: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} holds no JSON object; pass generation_config 'vllm' to leave it out")
    override = override or {}
    check_override(override)
    if ignored := sorted(set(override) - set(READ_KEYS)):
        logger.warning("override_generation_config: %s not read (only %s are)", ", ".join(ignored),
                       ", ".join(READ_KEYS))
    params = _as_params({**config, **override}, path or "override_generation_config",
                        "; pass generation_config 'vllm' to leave the file's defaults out")
    if params:
        logger.info("default sampling parameters from %s (for requests that leave them unset): %s",
                    " and ".join(filter(None, [path, "override_generation_config" if override else None])), params)
    return params
