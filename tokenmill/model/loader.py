"""Build a model on its device and fill it: sharded safetensors, GGUF (linear weights kept quantized on the
CPU, else dequantized), or dummy."""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from tokenmill.config import ModelConfig, check_model_path
from tokenmill.cpu_compile import cpu_flags
from tokenmill.layers.quant import (
    check_moe_experts,
    process_weights_after_loading,
    quantize_linear_layers,
    resolve_quant_config,
)
from tokenmill.model.base import LLAMA_STACKED_PARAMS
from tokenmill.model.gguf_cache import config_kept_on_disk, gguf_header, remembered
from tokenmill.model.registry import get_model_class, supported_architectures
from tokenmill.model.stage import owned_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def load_hf_config(model_config: ModelConfig) -> PretrainedConfig:
    """The model's config with ModelConfig.hf_overrides applied: every process that builds the model or sizes its
    context (the frontend, the engine core, each worker) reads it here, so all see the same overrides."""
    config = _read_hf_config(model_config)
    if model_config.hf_overrides:
        apply_hf_overrides(config, model_config.hf_overrides)
    return config


def apply_hf_overrides(config: PretrainedConfig, overrides: dict) -> None:
    """vLLM's hf_overrides: each key set on the config; a dict onto a nested config (text_config, ...) updates
    that config's keys."""
    for key, value in overrides.items():
        nested = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(nested, PretrainedConfig):
            apply_hf_overrides(nested, value)
        elif key in ("rope_scaling", "rope_parameters") and isinstance(value, dict) and "rope_theta" not in value:
            # transformers 5 keeps rope_theta inside the RoPE parameters: a new scaling would drop the base.
            theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
            theta = theta if theta is not None else getattr(config, "rope_theta", None)
            setattr(config, key, value if theta is None else {**value, "rope_theta": theta})
        else:
            setattr(config, key, value)


def _read_hf_config(model_config: ModelConfig) -> PretrainedConfig:
    path = model_config.model
    if is_gguf(path):
        return copy.deepcopy(remembered("config", path, lambda: _gguf_config(path)))  # callers may change it
    check_model_path(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"model folder {path!r} has no config.json: pass a Hugging Face model folder "
                                f"(config.json and *.safetensors) or a .gguf file")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # transformers says only "not a valid JSON file"
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    _check_config_json(raw, config_file)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if not getattr(config, "architectures", None):
        _name_architecture_from_model_type(config, config_file)
    return config


def _check_config_json(raw: object, config_file: str) -> None:
    """What transformers would fail on with a traceback or a paragraph, said in a line: a model_type it does
    not know (its error is about upgrading it, though tokenmill could not load such a model anyway; a model
    with its own code, `auto_map`, is left to transformers and --trust-remote-code), a quantization_config
    that is no mapping (it fails printing the config)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} is not a JSON object of model settings: is it a model's config.json?")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING and "auto_map" not in raw:
        raise ValueError(f"{config_file}: model_type {model_type!r} is not supported; supported architectures: "
                         f"{', '.join(supported_architectures())}")
    quantization = raw.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ValueError(f"{config_file}: quantization_config must be a JSON object with a quant_method, got "
                         f"{quantization!r}")


def _name_architecture_from_model_type(config: PretrainedConfig, config_file: str) -> None:
    """A config.json without `architectures` loads as the class transformers' AutoModelForCausalLM would build
    for its model_type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture is None:
        raise ValueError(f"{config_file} names no architectures and its model_type {config.model_type!r} is no "
                         f"causal LM transformers knows: add e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    logger.info("%s names no architectures: loading it as %s, after its model_type %r", config_file, architecture,
                config.model_type)
    config.architectures = [architecture]


def _gguf_config(path: str) -> PretrainedConfig:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tokenmill.model.gguf_config import with_missing_fields
    from tokenmill.model.gguf_moe import moe_config

    try:
        config = config_kept_on_disk(path, lambda: AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                                        gguf_file=os.path.basename(path)))
    except (ValueError, IndexError, struct.error) as e:
        if "magic" in str(e):  # not a GGUF at all: the message says so
            raise
        if "architecture" in str(e):  # a family transformers cannot read
            raise ValueError(f"{path}: {e} Supported: {', '.join(supported_architectures())}") from None
        # gguf's reader fails on a cut-off file with a numpy reshape error that names neither the file nor why.
        raise ValueError(f"cannot read {path} ({os.path.getsize(path):,} bytes) as a GGUF file: {e}. A partial "
                         f"download fails this way: download it again") from None
    config = moe_config(path, config)  # the experts' fields transformers leaves out; Mixtral's class
    config = with_missing_fields(path, config)  # Phi-3's and Gemma 2's; RoPE scaling stored as a tensor
    # GGUF metadata names the family but not the class.
    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
    return config


# CPU flags (as /proc/cpuinfo names them) of units that compute bfloat16 natively: AVX512_BF16's dot
# products, AMX's tiles. Without them bfloat16 is converted to float32 and back around every op, which on
# the CPU is several times slower than float32 itself.
_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_auto_dtype(flags: set[str]) -> tuple[torch.dtype, str]:
    """dtype='auto' on the CPU: bfloat16 where the CPU has bfloat16 units, else float32; and why."""
    found = [flag for flag in _CPU_BF16_FLAGS if flag in flags]
    if found:
        return torch.bfloat16, f"the CPU computes bfloat16 natively ({', '.join(found)})"
    return torch.float32, f"the CPU has no bfloat16 units ({' or '.join(_CPU_BF16_FLAGS)}): float32 is faster"


def resolve_dtype(model_config: ModelConfig, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if model_config.dtype != "auto":
        return _DTYPES[model_config.dtype]
    if device.type == "cpu":
        dtype, reason = cpu_auto_dtype(cpu_flags())
        logger.info("dtype 'auto' on the CPU: %s, since %s (dtype=... overrides)", str(dtype).removeprefix("torch."),
                    reason)
        return dtype
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    ckpt = _DTYPES.get(ckpt, ckpt) if isinstance(ckpt, str) else ckpt
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_config: ModelConfig, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    model_class = get_model_class(hf_config.architectures)
    load_format = model_config.load_format
    if load_format == "auto":
        load_format = "gguf" if is_gguf(model_config.model) else "safetensors"
    elif (load_format == "gguf" and os.path.isdir(model_config.model)) or (
            load_format == "safetensors" and model_config.model.endswith(".gguf")):
        # Else the reader of the other format meets the path: a traceback reading a folder as a GGUF file.
        given = "a model folder" if load_format == "gguf" else "a .gguf file"
        raise ValueError(f"--load-format {load_format} does not read {given} ({model_config.model!r}): leave "
                         f"--load-format out (auto), which picks the reader from the path")
    requested, checkpoint_quant = model_config.quantization, getattr(hf_config, "quantization_config", None)
    if load_format == "gguf" and _num_experts(hf_config):
        from tokenmill.model.gguf_moe import GGUF_MOE_ARCHITECTURES

        if hf_config.architectures[0] not in GGUF_MOE_ARCHITECTURES:
            raise ValueError(f"GGUF files of mixture-of-experts models ({hf_config.architectures}) load for "
                             f"{', '.join(GGUF_MOE_ARCHITECTURES)} only: load the model's safetensors checkpoint")
    if load_format == "gguf":
        form = _gguf_form(model_config, hf_config, model_class, device, dtype)
        if form != "dense":  # the file's own types, as a checkpoint would name them
            checkpoint_quant = {"quant_method": "gguf", "dense_copy": form == "blocks and dense"}
        elif requested == "gguf":
            requested = None  # named, but this device dequantizes (logged)
        if requested not in (None, "gguf", "fp8"):  # fp8: dequantized, then quantized at load
            raise ValueError(f"--quantization {requested} loads checkpoints in that format; a .gguf file holds its "
                             f"own quantized types: leave --quantization out")
    quant_config = resolve_quant_config(requested, checkpoint_quant)
    if quant_config is not None and _num_experts(hf_config):
        with torch.device("meta"):  # refuse quantized experts before the real model takes its memory
            check_moe_experts(model_class(hf_config), quant_config)
    stacked_params = None
    with torch.device(device), _default_dtype(dtype):
        model = model_class(hf_config)
        if quant_config is not None:
            stacked_params = getattr(model, "stacked_params", LLAMA_STACKED_PARAMS)
            quantize_linear_layers(model, quant_config, stacked_params)
    if load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
    elif load_format == "gguf":
        keep = _gguf_quantized_weights(model, stacked_params) if stacked_params is not None else None
        model.load_weights(owned_weights(model, iter_gguf_weights(model_config.model, hf_config, keep)))
    else:  # a pipeline stage skips the tensors of other stages' layers
        model.load_weights(owned_weights(model, iter_safetensors_weights(model_config.model)))
    with torch.device(device):
        process_weights_after_loading(model)
    if quant_config is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights an online method replaced
    return model.eval()


def _num_experts(hf_config: PretrainedConfig) -> int:
    """The routed experts of a mixture-of-experts config (Qwen-MoE, Mixtral, DeepSeek names); 0 if dense."""
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    return next((value for name in names if (value := getattr(hf_config, name, None))), 0)


def _gguf_form(model_config: ModelConfig, hf_config: PretrainedConfig, model_class: type[nn.Module],
               device: torch.device, dtype: torch.dtype) -> str:
    """How a GGUF's linear weights are held: "blocks" (their GGML types, layers.quant.gguf), "blocks and dense"
    (also a dense copy for steps of many rows) or "dense" (dequantized at load). Blocks on the CPU in float32
    unless `gguf_dequantize`, or where `quantization="gguf"` asks (on CUDA: the integer-weight kernels, for
    dense models); elsewhere there is no quantized GEMM."""
    if model_config.gguf_dequantize:
        if model_config.quantization == "gguf":
            raise ValueError("quantization 'gguf' keeps GGUF weights quantized and gguf_dequantize dequantizes "
                             "them: pass one of the two")
        return "dense"
    if model_config.quantization not in (None, "gguf"):
        # Another method (fp8) quantizes the GGUF's dequantized weights: it starts from the dense model.
        return "dense"
    from tokenmill.layers.quant.gguf import uses_int_layout

    if model_config.quantization != "gguf":
        if device.type == "cpu":
            return _gguf_form_on_cpu(hf_config, model_class, dtype)
        # The integer kernels are not yet faster than bfloat16 at decode (BENCHMARKS.md): opt-in only.
        logger.info("GGUF on %s: every tensor is dequantized at load%s", device.type,
                    " (quantization='gguf' keeps 4/8-bit weights, for less memory)"
                    if uses_int_layout(device) and not _num_experts(hf_config) else "")
        return "dense"
    if uses_int_layout(device) and not _num_experts(hf_config):
        logger.info("GGUF on %s: Q4_0, Q4_1, Q8_0 and Q4_K weights kept in 4 or 8 bits for the integer-weight "
                    "kernels, other types dequantized at load (layers.quant.gguf_int)", device.type)
        return "blocks"
    if device.type != "cpu":
        logger.info("GGUF on %s: no quantized GEMM for this device, every tensor is dequantized at load",
                    device.type)
        return "dense"
    return "blocks"


def _gguf_form_on_cpu(hf_config: PretrainedConfig, model_class: type[nn.Module], dtype: torch.dtype) -> str:
    """The blocks win at a decode step's few rows (the float32 kernel, 5-6 bits a weight), oneDNN's dense GEMM
    from a handful of rows (the blocks alone at batch 64: 0.94x in bfloat16, 0.73x in float32), so a small model
    keeps both forms (layers.quant.gguf.few_rows). A larger one keeps the blocks alone in float32 (memory-bound
    decoding reads a seventh of the bytes) and is dequantized at load in bfloat16, as are MoE experts in 16 bits
    (no dense copy for them) and float16 (the kernel has only its float32 path there). quantization='gguf'
    keeps the blocks alone anyway."""
    from tokenmill.layers.quant.gguf import DENSE_COPY_MAX_BYTES, few_rows

    name = str(dtype).removeprefix("torch.")
    alone = "blocks" if dtype == torch.float32 else "dense"  # without a copy
    if dtype not in (torch.float32, torch.bfloat16) or (_num_experts(hf_config) and dtype != torch.float32):
        logger.info("GGUF in %s on the CPU: dequantized at load (dtype=float32 or quantization='gguf' keeps the "
                    "GGML blocks)", name)
        return "dense"
    if _num_experts(hf_config):
        return "blocks"
    dense_bytes = _linear_weight_bytes(hf_config, model_class, dtype)
    if dense_bytes > DENSE_COPY_MAX_BYTES:
        logger.info("GGUF in %s on the CPU: %s, since a dense copy beside the GGML blocks would take %.0f MB of "
                    "linear weights, over the %.0f MB limit", name,
                    "the GGML blocks alone" if alone == "blocks" else "dequantized at load", dense_bytes / 1e6,
                    DENSE_COPY_MAX_BYTES / 1e6)
        return alone
    logger.info("GGUF in %s on the CPU: linear layers keep their GGML blocks for steps of up to %d rows and a "
                "dense %s copy (%.0f MB, limit %.0f MB; in bfloat16 on CPUs with AMX, Q4_0 and Q4_1 layers keep their "
                "blocks repacked for the AMX kernel instead) for more rows (gguf_dequantize=True keeps the dense "
                "weights alone, quantization='gguf' the blocks alone)", name, few_rows(dtype), name, dense_bytes / 1e6,
                DENSE_COPY_MAX_BYTES / 1e6)
    return "blocks and dense"


def _linear_weight_bytes(hf_config: PretrainedConfig, model_class: type[nn.Module], dtype: torch.dtype) -> int:
    """The bytes of the model's quantizable linear weights in `dtype` (from a free meta-device build)."""
    from tokenmill.layers.linear import LinearBase

    with torch.device("meta"):
        model = model_class(hf_config)
    return sum(m.output_size * m.input_size * dtype.itemsize for m in model.modules()
               if isinstance(m, LinearBase) and getattr(m, "quantizable", True))


def _gguf_quantized_weights(model: nn.Module, stacked_params: dict[str, tuple[str, str | int]]):
    """name -> whether the Hugging Face tensor `name` loads into a layer that keeps GGUF blocks."""
    from tokenmill.layers.quant.gguf import GGUFLinearMethod
    from tokenmill.layers.quant.gguf_moe import GGUFMoEMethod

    layers = {name for name, module in model.named_modules()
              if isinstance(getattr(module, "quant_method", None), GGUFLinearMethod)}
    experts = {name for name, module in model.named_modules()
               if isinstance(getattr(module, "quant_method", None), GGUFMoEMethod)}

    def keep(name: str) -> bool:
        if ".experts." in name:  # model.layers.N.mlp.experts.E.gate_proj.weight (model.gguf_moe)
            return name.partition(".experts.")[0] + ".experts" in experts
        module, _, kind = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        leaf = stacked_params.get(leaf, (leaf,))[0]  # q_proj -> qkv_proj
        return kind == "weight" and (f"{prefix}.{leaf}" if prefix else leaf) in layers

    return keep


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small random values: speed does not depend on them, but NaNs or overflow would skew it."""
    # Drawn where the parameters live: on a GPU an 8B model fills in well under a second.
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for param in model.parameters():
        if getattr(param, "kept_by_dummy_load", False):  # a format's metadata (a shape its reader checks)
            continue
        values = torch.empty(param.shape, dtype=torch.float32, device=device).uniform_(-1e-3, 1e-3, generator=generator)
        param.data.copy_(values)
    for name, module in model.named_modules():
        if "norm" in name.rsplit(".", 1)[-1] and getattr(module, "weight", None) is not None:
            module.weight.data.fill_(1.0 - getattr(module, "offset", 0.0))


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(folder)
    for file in tqdm(files, desc="Loading safetensors shards", disable=len(files) < 2):
        try:
            opened = safe_open(file, framework="pt")
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e}); a partial download fails this "
                             f"way: download it again") from None
        with opened as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's shards: those its index names (each must exist), else every *.safetensors file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {folder!r}")
        return files
    with open(index) as f:
        files = sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
    missing = [os.path.basename(file) for file in files if not os.path.isfile(file)]
    if missing:
        raise FileNotFoundError(f"{index} names {len(missing)} shard(s) missing from the folder: "
                                f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}; download them")
    return files


def iter_gguf_weights(path: str, hf_config: PretrainedConfig,
                      keep_quantized: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a model under Hugging Face names: the file's header (model.gguf_file), gguf's name map,
    plus transformers' per-family fixes, and stacked MoE experts split per expert (model.gguf_moe). Tensors
    are dequantized to float32, except where `keep_quantized(name)` holds for a tensor of a type
    layers.quant.gguf multiplies (or layers.quant.gguf_moe, for experts): those come as their raw rows, a uint8
    [rows, row_bytes] tensor tagged with its GGML type (layers.quant.gguf.tag_ggml). With `keep_quantized`,
    the other matrices of those types (the embedding, the LM head) come dense with their raw rows as
    `ggml_blocks`.

    NOTE: transformers' load_gguf_checkpoint does the same but re-parses the metadata and builds the
    name map once per submodule (~8 s of a ~20 s load for SmolLM2-135M); here each happens once.
    """
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from tokenmill.layers.quant.gguf import QUANTIZED_TYPES, tag_ggml
    from tokenmill.model.gguf_moe import expert_weights, is_expert_tensor

    header = gguf_header(path)
    arch_name = header.metadata.get("general.architecture")
    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to the installed gguf package")
    # GGUF name -> HF name, from the parameter names of a (free) meta-device transformers model.
    name_map = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = AutoModelForCausalLM.from_config(hf_config).state_dict().keys()
    to_hf = {gguf_name: n for n in hf_names if (gguf_name := name_map.get_name(n, (".weight", ".bias")))}
    # The processor undoes llama.cpp's conversion tweaks (the q/k rotary permutation for llama).
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=hf_config.to_dict())
    # Processors known to move only whole rows of linear weights (llama's permutation) or to touch only
    # norms and routers (Qwen-MoE's, whose experts come through expert_weights instead): raw rows go through
    # them unchanged in meaning. Others see dequantized values only.
    if type(processor) not in (TensorProcessor, hf_gguf.LlamaTensorProcessor, hf_gguf.Gemma2TensorProcessor,
                               hf_gguf.Qwen2MoeTensorProcessor):
        keep_quantized = None
    for tensor in header.tensors:
        if is_expert_tensor(tensor.name):  # llama.cpp's stacked experts, one expert at a time
            raw_type = int(tensor.tensor_type) in QUANTIZED_TYPES
            yield from expert_weights(tensor, hf_config.model_type, keep_quantized if raw_type else None)
            continue
        hf_name = to_hf.get(tensor.name)
        raw = (keep_quantized is not None and hf_name is not None and int(tensor.tensor_type) in QUANTIZED_TYPES
               and len(tensor.data.shape) == 2 and keep_quantized(hf_name))
        weights = tensor.data if raw else dequantize(tensor.data, tensor.tensor_type)
        if ".ffn_gate_inp_shexp." in tensor.name:  # Qwen2-MoE's shared-expert gate: [H] or [1, H] in files,
            weights = weights.reshape(-1)  # [H] where the processor makes it HF's [1, H]
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=to_hf,
                                   parsed_parameters={"tensors": {}})
        if result.name in to_hf:
            out = torch.from_numpy(np.copy(result.weights))
            if raw:
                out = tag_ggml(out, int(tensor.tensor_type))
            elif keep_quantized is not None and int(tensor.tensor_type) in QUANTIZED_TYPES and out.dim() == 2:
                # The embedding table loads dense (a lookup table) and carries its blocks, which the CPU LM head
                # reads for a few rows (layers.cpu_lm_head). The processors allowed above leave its rows alone.
                out.ggml_blocks = tag_ggml(torch.from_numpy(np.copy(tensor.data)), int(tensor.tensor_type))
            yield to_hf[result.name], out
