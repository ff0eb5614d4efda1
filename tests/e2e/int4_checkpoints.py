"""Integer-weight checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) of a transformers model, written
in each format's published layout by round-to-nearest (tests only).

Each writer also saves the dequantized dense twin: what the checkpoint means. GPTQ and AWQ words are packed
here straight from the formats' descriptions (a shift per slot, not tokenmill's packer, so that one misreading
shared by writer and reader cannot pass); compressed-tensors checkpoints are compressed, and their twins
decompressed, by the compressed-tensors library itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.e2e.quant_checkpoints import _save, is_linear_weight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: slot i of a word holds column AWQ_ORDER[i] of its eight


def rtn(weight: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor | None = None,
        min_zero: int = 0):
    """Round-to-nearest: (q [n, k] unsigned, scale [n, groups] fp16, zero [n, groups] int64, g_idx [k]).
    group 0: per channel. perm (act-order): the groups gather features perm[0:g], perm[g:2g], ..."""
    n, k = weight.shape
    size = k if group == 0 else group
    perm = torch.arange(k) if perm is None else perm
    w = weight.float()[:, perm].reshape(n, k // size, size)
    top = (1 << bits) - 1
    if sym:
        scale = (w.abs().amax(-1) * 2 / top).clamp(min=1e-8).half().float()
        zero = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8).half().float()
        zero = (-lo / scale).round().clamp(min_zero, top).long()
    q_sorted = (w / scale[..., None]).round().add(zero[..., None]).clamp(0, top).long().reshape(n, k)
    q = torch.empty_like(q_sorted)
    q[:, perm] = q_sorted
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    return q, scale.half(), zero, g_idx


def dequantize(q, scale, zero, g_idx) -> torch.Tensor:
    gi = g_idx.long()
    return (q.float() - zero[:, gi].float()) * scale[:, gi].float()


def pack_words(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """values [..., m] -> int32 words [..., m * bits / 32] along the last dim: slot i (bits i*b .. i*b + b - 1)
    of word c holds value c * pack + order[i] (order: in position order)."""
    pack = 32 // bits
    order = order or list(range(pack))
    v = values.long().reshape(*values.shape[:-1], -1, pack)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for slot in range(pack):
        word |= v[..., order[slot]] << (bits * slot)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the bit pattern, as int32


def gptq_tensors(weight, bits, group, sym, perm=None, version=1):
    q, scale, zero, g_idx = rtn(weight, bits, group, sym, perm, min_zero=version)  # v1 cannot store zero 0
    stored = zero - version  # v1: zero - 1
    tensors = {"qweight": pack_words(q, bits).T.contiguous(),  # [k / pack, n]: packed along the input
               "qzeros": pack_words(stored.T.contiguous(), bits),  # [groups, n / pack]: along the output
               "scales": scale.T.contiguous(), "g_idx": g_idx}
    return tensors, dequantize(q, scale, zero, g_idx)


def awq_tensors(weight, group):
    q, scale, zero, g_idx = rtn(weight, 4, group, sym=False)
    tensors = {"qweight": pack_words(q.T.contiguous(), 4, AWQ_ORDER),  # [k, n / 8]
               "qzeros": pack_words(zero.T.contiguous(), 4, AWQ_ORDER), "scales": scale.T.contiguous()}
    return tensors, dequantize(q, scale, zero, g_idx)


def ct_tensors(weight, bits, group, sym):
    """compressed-tensors' own calculate_qparams, compressor and decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args, scheme = ct_scheme(bits, group, sym)
    n, k = weight.shape
    w = weight.float()
    tiles = w.reshape(n, k // group, group) if group else w.reshape(n, 1, k)
    scale, zero = calculate_qparams(tiles.amin(-1), tiles.amax(-1), args)
    scale = scale.half()  # as checkpoints ship them; float32 below only to decompress without rounding
    state = {"weight": w, "weight_scale": scale.float(), "weight_zero_point": zero}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    dense = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    packed["weight_scale"] = scale
    return packed, dense


def ct_act_order_tensors(weight, bits, group, sym, perm):
    """compressed-tensors with `actorder: "group"`: round-to-nearest over the permuted groups (the library's
    compressor quantizes without g_idx), packed by the library's pack_to_int32 (signed values, as its compressor
    packs them), `weight_g_idx` beside."""
    from compressed_tensors.compressors.pack_quantized.base import pack_to_int32

    q, scale, zero, g_idx = rtn(weight, bits, group, sym, perm)
    offset = 1 << (bits - 1)
    tensors = {"weight_packed": pack_to_int32((q - offset).to(torch.int8), bits),
               "weight_shape": torch.tensor(weight.shape), "weight_scale": scale, "weight_g_idx": g_idx}
    if not sym:
        tensors["weight_zero_point"] = pack_to_int32((zero - offset).to(torch.int8), bits, packed_dim=0).contiguous()
    return tensors, dequantize(q, scale, zero, g_idx)


def ct_scheme(bits, group, sym):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="group" if group else "channel",
                            group_size=group or None)
    return args, QuantizationScheme(targets=["Linear"], weights=args)


def _shared_perms(state: dict, seed: int) -> dict[str, torch.Tensor]:
    """Act-order permutations: one per input (q/k/v share theirs, as do gate/up: the calibration orders
    the features of an input by its statistics, the same for every projection reading it)."""
    g = torch.Generator().manual_seed(seed)
    perms = {}
    for name, tensor in state.items():
        if is_linear_weight(name):
            key = _input_key(name)
            if key not in perms:
                perms[key] = torch.randperm(tensor.shape[1], generator=g)
    return perms


def _input_key(name: str) -> str:
    for parts, shared in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
        for part in parts:
            name = name.replace(f".{part}.", f".{shared}.")
    return name


def write_int4(model, path: Path, fmt: str, bits: int = 4, group: int = 128, sym: bool = True,
               act_order: bool = False, skip: tuple[str, ...] = (), version: int = 1, seed: int = 0) -> tuple[str, str]:
    """(quantized checkpoint, its dequantized dense twin). fmt: gptq | awq | ct (pack-quantized).
    group 0: per channel. version (gptq): 1 stores zero - 1 ("gptq"), 0 the zero itself ("gptq_v2")."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    perms = _shared_perms(state, seed) if act_order else {}
    quantized, dense = {}, {}
    for name, tensor in state.items():
        if not is_linear_weight(name) or any(s in name for s in skip):
            quantized[name] = dense[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if fmt == "gptq":
            tensors, deq = gptq_tensors(tensor, bits, group, sym, perms.get(_input_key(name)), version)
        elif fmt == "awq":
            tensors, deq = awq_tensors(tensor, group)
        elif act_order:
            tensors, deq = ct_act_order_tensors(tensor, bits, group, sym, perms[_input_key(name)])
        else:
            tensors, deq = ct_tensors(tensor, bits, group, sym)
        quantized.update({f"{prefix}.{k}": v for k, v in tensors.items()})
        dense[name] = deq.to(tensor.dtype)
    if fmt == "gptq":
        config = {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": act_order,
                  "sym": sym, "checkpoint_format": "gptq" if version else "gptq_v2", "true_sequential": True,
                  "damp_percent": 0.01, "static_groups": False}
        if skip:
            config["modules_to_not_convert"] = list(skip)
    elif fmt == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": group or -1, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": list(skip) or None}
    else:
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig(config_groups={"group_0": ct_scheme(bits, group, sym)[1]}, format="pack-quantized",
                                    quantization_status="compressed",
                                    ignore=["lm_head", *(f"re:.*{s}" for s in skip)]).model_dump()
        if act_order:  # as llm-compressor wrote it (today's compressed-tensors no longer makes "group" itself)
            config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    name = f"{fmt}-int{bits}-g{group}-{'sym' if sym else 'asym'}{'-act' if act_order else ''}-v{version}"
    return _save(model, path / name, quantized, config), _save(model, path / f"{name}-dense", dense, None)


def quantized_layer(fmt: str, n: int, k: int, group: int, sym: bool, act_order: bool, device: str, seed: int = 0):
    """One ReplicatedLinear holding a random weight in `fmt`, loaded and repacked as the engine does; and the
    dense weight the checkpoint means."""
    from tokenmill.layers.linear import ReplicatedLinear
    from tokenmill.layers.quant import QUANT_CONFIGS

    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * k**-0.5
    if fmt == "gptq":
        perm = torch.randperm(k, generator=g) if act_order else None
        tensors, deq = gptq_tensors(weight, 4, group, sym, perm)
        config = {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "desc_act": act_order, "sym": sym}
    elif fmt == "awq":
        tensors, deq = awq_tensors(weight, group)
        config = {"quant_method": "awq", "bits": 4, "group_size": group or -1, "zero_point": True, "version": "gemm"}
    else:
        tensors, deq = ct_tensors(weight, 4, group, sym)
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig(config_groups={"group_0": ct_scheme(4, group, sym)[1]},
                                    format="pack-quantized").model_dump()
    quant = QUANT_CONFIGS[config["quant_method"]].from_checkpoint(config)
    with torch.device(device):
        layer = ReplicatedLinear(k, n)
        layer.set_quant_method(quant.linear_method("layer"))
        params = dict(layer.named_parameters())
        for name, tensor in tensors.items():
            params[name].weight_loader(params[name], tensor.to(device))
        layer.quant_method.process_weights_after_loading(layer)
    return layer, deq
