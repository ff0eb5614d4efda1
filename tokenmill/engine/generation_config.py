"""generation_config.json's sampling defaults (vLLM's generation_config): one reading for the server's requests
and the offline LLM's."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
"""Where a Hugging Face model folder keeps its default sampling parameters."""
READ_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""The keys read -> the sampling parameter each sets, as vLLM reads them; do_sample and the rest are not read."""


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


def sampling_defaults(setting: str, model: str | None) -> dict[str, Any]:
    """The sampling parameters' defaults for requests that leave them unset (max_tokens also limits every server
    request), from the file `setting` names; {} for 'vllm'."""
    path = generation_config_file(setting, model)
    if path is None:
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the default sampling parameters of {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no JSON object; pass generation_config 'vllm' to leave it out")
    params = {READ_KEYS[key]: value for key, value in config.items() if key in READ_KEYS and value is not None}
    try:
        SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}; pass generation_config 'vllm' to leave its defaults out") from None
    if params:
        logger.info("default sampling parameters from %s (for requests that leave them unset): %s", path, params)
    return params
