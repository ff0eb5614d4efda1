"""Loading a speculative draft model or EAGLE head beside the target: same device and dtype, checked at start-up."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from tokenmill.config import EAGLE3_ARCHITECTURES, EngineConfig
from tokenmill.distributed.parallel_state import get_tp_size
from tokenmill.layers.attention import Attention
from tokenmill.layers.rotary import max_rope_positions
from tokenmill.model.loader import load_hf_config, load_model

logger = logging.getLogger(__name__)


def load_draft_model(config: EngineConfig, target: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> nn.Module:
    """The draft model of `speculative_config.model`, loaded as the target is (dtype, load_format, seed)."""
    # The draft's own checkpoint says if it is quantized; the target's hf_overrides are the target's (as vLLM's).
    model_config = dataclasses.replace(config.model_config, model=config.speculative_config.model, tokenizer=None,
                                       quantization=None, hf_overrides=None)
    draft = load_hf_config(model_config)
    check_fits("the draft model", draft, target, max_model_len)
    from tokenmill.executor.base import check_tensor_parallel  # (the executor module imports this one's users)

    try:  # the draft shards over the target's ranks as the target does
        check_tensor_parallel(draft, get_tp_size())
    except ValueError as e:
        raise ValueError(f"the draft model: {e}") from None
    start = time.perf_counter()
    model = load_model(model_config, draft, device, dtype)
    logger.info("loaded draft model %s (%s) in %.1f s", type(model).__name__, dtype, time.perf_counter() - start)
    return model


def check_fits(what: str, draft: PretrainedConfig, target: PretrainedConfig, max_model_len: int) -> None:
    """A drafter shares the target's vocabulary and takes every position the target may reach."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{what}'s vocabulary ({draft.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}): a drafter must share the target's tokenizer")
    draft_len = max_rope_positions(draft)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(f"{what} takes {draft_len} positions, fewer than max_model_len={max_model_len}: "
                         f"lower max_model_len")


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_bytes_per_block(layers: list[Attention], dtype: torch.dtype, block_size: int) -> int:
    return sum(layer.kv_cache_bytes_per_token(dtype) for layer in layers) * block_size


def load_eagle_head(config: EngineConfig, target_config: PretrainedConfig, target: nn.Module, device: torch.device,
                    dtype: torch.dtype, max_model_len: int) -> nn.Module:
    """The EAGLE-1 head of `speculative_config.model`: a folder with config.json and safetensors or
    pytorch_model*.bin tensors in the published layout (spec/eagle.py), sharing the target's embedding
    (unless it brings one) and LM head."""
    from tokenmill.layers.quant import process_weights_after_loading
    from tokenmill.spec.eagle import EagleHead, eagle_tensor_name

    path = Path(config.speculative_config.model)
    head_config = _head_config(path, "eagle")
    if set(getattr(head_config, "architectures", None) or ()) & set(EAGLE3_ARCHITECTURES):
        raise ValueError(f"{path} is an EAGLE-3 head: use the speculative method 'eagle3'")
    if head_config.hidden_size != target_config.hidden_size:
        raise ValueError(f"the EAGLE head's hidden size ({head_config.hidden_size}) is not the target's "
                         f"({target_config.hidden_size})")
    check_fits("the EAGLE head", head_config, target_config, max_model_len=0)  # positions: as EAGLE-3's below
    # RoPE has no learned positions: the head's table covers every position the target may reach (heads ship the
    # length they were trained at, often below the target's, e.g. 8192 for a 128K target).
    head_config.max_position_embeddings = max(getattr(head_config, "max_position_embeddings", 0), max_model_len)
    target_embed = getattr(getattr(target, "model", None), "embed_tokens", None)
    if target_embed is None:
        raise ValueError(f"EAGLE needs a target with a Llama-style embedding (model.embed_tokens); "
                         f"{type(target).__name__} has none")
    weights = {eagle_tensor_name(name): tensor for name, tensor in _read_tensors(path)}
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(head_config, set(weights), target_embed, target.compute_logits)
    finally:
        torch.set_default_dtype(previous)
    head.load_weights(weights.items())
    with torch.device(device):
        process_weights_after_loading(head)
    logger.info("loaded EAGLE head (%d layers, %s) in %.1f s", head_config.num_hidden_layers, dtype,
                time.perf_counter() - start)
    return head.eval()


def load_eagle3_head(config: EngineConfig, target_config: PretrainedConfig, target: nn.Module, device: torch.device,
                     dtype: torch.dtype, max_model_len: int) -> nn.Module:
    """The EAGLE-3 head of `speculative_config.model` (spec/eagle3.py), checked against the target, which
    is set to also return its residual stream at the head's auxiliary layers."""
    from tokenmill.layers.quant import process_weights_after_loading
    from tokenmill.spec.eagle3 import Eagle3Head, aux_layers_of, eagle3_tensor_name

    path = Path(config.speculative_config.model)
    head_config = _head_config(path, "eagle3")
    if not set(getattr(head_config, "architectures", None) or ()) & set(EAGLE3_ARCHITECTURES):
        raise ValueError(f"{path} is not an EAGLE-3 head: its config.json names architectures "
                         f"{getattr(head_config, 'architectures', None)}, not one of {list(EAGLE3_ARCHITECTURES)} "
                         f"(an EAGLE-1 head takes the method 'eagle', a whole model 'draft_model')")
    if head_config.num_hidden_layers != 1:
        raise ValueError(f"an EAGLE-3 head has one decoder layer; {path} has {head_config.num_hidden_layers}")
    check_fits("the EAGLE-3 head", head_config, target_config, max_model_len=0)  # positions: see RoPE below
    target_model = getattr(target, "model", None)
    if not hasattr(target_model, "aux_hidden_state_layers"):
        raise ValueError(f"EAGLE-3 needs a target that hands over its intermediate hidden states (the Llama "
                         f"family's decoder stack); {type(target).__name__} does not")
    aux_layers = aux_layers_of(head_config, len(target_model.layers))
    target_hidden = getattr(head_config, "target_hidden_size", None) or head_config.hidden_size
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"the EAGLE-3 head was trained on a target of hidden size {target_hidden}, this target's "
                         f"is {target_config.hidden_size}")
    weights = {eagle3_tensor_name(name): tensor for name, tensor in _read_tensors(path)}
    if head_config.hidden_size != target_config.hidden_size and "embed_tokens.weight" not in weights:
        raise ValueError(f"the EAGLE-3 head's width ({head_config.hidden_size}) is not the target's "
                         f"({target_config.hidden_size}) and it brings no embed_tokens of its own")
    draft_vocab = getattr(head_config, "draft_vocab_size", None) or head_config.vocab_size
    if draft_vocab != target_config.vocab_size and "d2t" not in weights:
        raise ValueError(f"the EAGLE-3 head drafts over {draft_vocab} tokens but has no d2t tensor mapping them to "
                         f"the target's {target_config.vocab_size}")
    fc = weights.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (head_config.hidden_size, len(aux_layers) * target_hidden):
        raise ValueError(f"the EAGLE-3 head's fc.weight is {list(fc.shape)}, not [{head_config.hidden_size}, "
                         f"{len(aux_layers)} * {target_hidden}] for the auxiliary layers {list(aux_layers)}")
    # RoPE has no learned positions: the head's table covers every position the target may reach.
    head_config.max_position_embeddings = max(getattr(head_config, "max_position_embeddings", 0), max_model_len)
    start = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(head_config, len(aux_layers), target_hidden, set(weights), target_model.embed_tokens)
    finally:
        torch.set_default_dtype(previous)
    head.load_weights(weights.items())
    with torch.device(device):
        process_weights_after_loading(head)
    target_model.aux_hidden_state_layers = aux_layers
    logger.info("loaded EAGLE-3 head (draft vocabulary %d, target layers %s, %s) in %.1f s", head.draft_vocab_size,
                list(aux_layers), dtype, time.perf_counter() - start)
    return head.eval()


def _head_config(path: Path, method: str) -> PretrainedConfig:
    """The head folder's config.json, said in a line where there is none (transformers' error for a file is an
    OSError about JSON, for a folder without it one about a model_type)."""
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative method {method!r} takes the EAGLE head's folder (config.json and its "
                         f"tensors); {str(path)!r} is {'a file' if path.is_file() else 'a folder without config.json'}"
                         f" (a whole draft model, a folder or a .gguf file, takes the method 'draft_model')")
    with open(path / "config.json") as f:
        raw = json.load(f)
    if isinstance(raw, dict) and "speculators_model_type" in raw:  # the `speculators` library's format
        from tokenmill.spec.eagle3 import speculators_head_config

        return speculators_head_config(raw, str(path / "config.json"))  # an EAGLE-3 architecture
    return AutoConfig.from_pretrained(path)


def _read_tensors(path: Path):
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(str(file)).items()
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin tensors in the EAGLE head folder {path}")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()
