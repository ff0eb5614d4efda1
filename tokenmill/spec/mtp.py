"""MTP proposer: DeepSeek-V3's own multi-token-prediction layer drafts from the target's hidden states.

The checkpoint ships num_nextn_predict_layers MTP modules after the decoder stack, as
`model.layers.{num_hidden_layers + i}.*`. Each is one full DeepSeek decoder layer (MLA + MoE) with, in front,
`enorm` and `hnorm` (RMSNorms) and `eh_proj` [hidden, 2 * hidden], and behind, `shared_head.norm` and
`shared_head.head` (the LM head; some checkpoints also carry a copy of `embed_tokens`). At position p it sees

    eh_proj(cat(enorm(embed(token[p + 1])), hnorm(h[p])))

where h[p] is the target's last hidden state at p after its final norm (the tensor DeepSeek's own modeling
code hands the MTP module, and that the target's LM head reads), and its output through shared_head gives
token[p + 2]. Drafts 2..k feed back the module's own output after shared_head.norm, so every step's
hidden input is a normed state as in training. The embedding at position 0 is zeroed, as the released
implementations do (the position has no preceding token in training).

Only the first MTP module drafts (DeepSeek-V3 and R1 ship one). The machinery is EAGLE-1's (spec/eagle.py,
EagleProposer): the target's states arrive through `observe`, the module's KV (MLA's latent rows) lives in
the target's blocks, drafts are greedy.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from glob import glob

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.config import EngineConfig
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.moe import load_moe_weights
from tokenmill.layers.norm import RMSNorm
from tokenmill.model.deepseek_v2 import DEEPSEEK_STACKED_PARAMS, DeepseekDecoderLayer, DeepseekV2ForCausalLM

logger = logging.getLogger(__name__)

# Tensors an MTP module may carry that equal the target's in the released checkpoints: shared when equal.
SHAREABLE = ("embed_tokens.weight", "shared_head.head.weight")


class MtpLayer(DeepseekDecoderLayer):
    """One MTP module: the decoder layer's modules plus enorm, hnorm, eh_proj and shared_head.norm (and, when
    the checkpoint's differ from the target's, its own embed_tokens and shared_head.head)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, is_v3: bool, own: set[str],
                 quantized_eh_proj: bool) -> None:
        super().__init__(config, layer_idx, is_v3)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        # FP8 checkpoints may keep eh_proj in 16 bits without listing it as excluded: a plain Linear then,
        # which the quantization pass leaves alone.
        linear = ReplicatedLinear if quantized_eh_proj else nn.Linear
        self.eh_proj = linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)
        if "shared_head.head.weight" in own:
            self.shared_head.head = ParallelLMHead(config.vocab_size, hidden)
        if "embed_tokens.weight" in own:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)


class MtpHead(nn.Module):
    """The first MTP module under its checkpoint name (`model.layers.{L}`), so that tensors and a quantized
    checkpoint's exclusions match by name; the target's embedding and LM head unless it brings its own."""

    def __init__(self, config: PretrainedConfig, is_v3: bool, own: set[str], target: DeepseekV2ForCausalLM,
                 quantized_eh_proj: bool = False) -> None:
        super().__init__()
        self.layer_name = str(config.num_hidden_layers)
        self.model = nn.Module()
        layer = MtpLayer(config, config.num_hidden_layers, is_v3, own, quantized_eh_proj)
        self.model.layers = nn.ModuleDict({self.layer_name: layer})
        # Plain attributes, not submodules: the target's are neither loaded nor counted twice.
        object.__setattr__(self, "_embed", layer.embed_tokens if "embed_tokens.weight" in own
                           else target.model.embed_tokens)
        object.__setattr__(self, "_lm_head", layer.shared_head.head if "shared_head.head.weight" in own
                           else target.lm_head)

    @property
    def mtp(self) -> MtpLayer:
        return self.model.layers[self.layer_name]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden]: the target's normed last states, or this head's own output."""
        layer = self.mtp
        embeds = self._embed(input_ids)  # [num_tokens, hidden]
        embeds = torch.where(positions[:, None] == 0, torch.zeros_like(embeds), embeds)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden_states)], dim=-1))
        x, residual = DeepseekDecoderLayer.forward(layer, positions, x, None)
        out, _ = layer.shared_head.norm(x, residual)
        return out  # [num_tokens, hidden], normed: the LM head's input, fed back for the next draft

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._lm_head.compute_logits(hidden_states)


def check_mtp_target(target: nn.Module, target_config: PretrainedConfig) -> None:
    num_mtp = getattr(target_config, "num_nextn_predict_layers", None) or 0
    if not isinstance(target, DeepseekV2ForCausalLM) or num_mtp < 1:
        raise ValueError(f"speculative method 'mtp' drafts with the target's own multi-token-prediction layers, and "
                         f"{type(target).__name__} has none (num_nextn_predict_layers={num_mtp}): use a DeepSeek-V3 "
                         f"checkpoint that ships them, or another method (ngram, draft_model, eagle, eagle3)")


def mtp_tensor_files(folder: str, prefix: str) -> dict[str, str]:
    """name -> safetensors file of every tensor under `prefix`, reading headers only (the index when there is one)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items() if name.startswith(prefix)}
    from safetensors import safe_open

    found = {}
    for file in sorted(glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            found.update((name, file) for name in f.keys() if name.startswith(prefix))
    return found


def _read(files: dict[str, str], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in in_file:
                yield name, f.get_tensor(name)


def _own_tensors(files: dict[str, str], prefix: str, target: DeepseekV2ForCausalLM) -> set[str]:
    """The shareable tensors the checkpoint holds with values other than the target's (those the head keeps). Under
    tensor parallelism each rank compares its own rows of the vocabulary (those its target module holds)."""
    targets = {"embed_tokens.weight": target.model.embed_tokens, "shared_head.head.weight": target.lm_head}
    own = set()
    for name, tensor in _read(files, [prefix + n for n in SHAREABLE if prefix + n in files]):
        short = name.removeprefix(prefix)
        module = targets[short]
        mine = module.weight
        rows = tensor[module.vocab_start : module.vocab_start + module.shard_size]
        if (tensor.shape != (module.vocab_size, mine.shape[1])
                or not torch.equal(rows.to(mine.device, mine.dtype), mine[: rows.shape[0]])):
            own.add(short)
    return own


def load_mtp_head(config: EngineConfig, target_config: PretrainedConfig, target: nn.Module, device: torch.device,
                  dtype: torch.dtype, max_model_len: int) -> MtpHead:
    """The target checkpoint's first MTP module, built beside the target (same dtype, quantization, device)."""
    from tokenmill.layers.quant import process_weights_after_loading, quantize_linear_layers, resolve_quant_config
    from tokenmill.model.loader import init_dummy_weights, is_gguf

    check_mtp_target(target, target_config)
    model_config = config.model_config
    dummy = model_config.load_format == "dummy"
    if not dummy and (model_config.load_format == "gguf" or is_gguf(model_config.model)):
        raise ValueError("speculative method 'mtp' reads the MTP layer from a safetensors checkpoint; GGUF files "
                         "carry none")
    prefix = f"model.layers.{target_config.num_hidden_layers}."
    files = {} if dummy else mtp_tensor_files(model_config.model, prefix)
    if not dummy and not files:
        raise ValueError(f"the checkpoint {model_config.model} has no tensors of its MTP layer ({prefix}*), though "
                         f"its config names num_nextn_predict_layers={target_config.num_nextn_predict_layers}")
    start = time.perf_counter()
    own = _own_tensors(files, prefix, target)
    quant_config = resolve_quant_config(model_config.quantization, getattr(target_config, "quantization_config", None))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            # Quantized only where the checkpoint stores it so (a scale beside its weight).
            quantized_eh_proj = quant_config is not None and (dummy or any(
                n.startswith(prefix + "eh_proj.") and n != prefix + "eh_proj.weight" for n in files))
            head = MtpHead(target_config, target.is_v3, own, target, quantized_eh_proj)
            if quant_config is not None:
                quantize_linear_layers(head, quant_config, DEEPSEEK_STACKED_PARAMS)
    finally:
        torch.set_default_dtype(previous)
    if dummy:
        init_dummy_weights(head, model_config.seed)
    else:
        shared = {prefix + n for n in SHAREABLE if n not in own}
        load_moe_weights(head, _read(files, [n for n in files if n not in shared]), DEEPSEEK_STACKED_PARAMS)
    with torch.device(device):
        process_weights_after_loading(head)
    logger.info("loaded the MTP layer %s* (the first of %d; own %s, %s) in %.1f s", prefix,
                target_config.num_nextn_predict_layers, sorted(own) or "none", dtype, time.perf_counter() - start)
    return head.eval()
