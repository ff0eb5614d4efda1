"""The default model as a Q4_K_M-style GGUF, for timing the CPU kernel's K-quant paths end to end.

    python3 benchmarks/gguf_k_quant_model.py /tmp/smollm2-q4_k_m.gguf
    python3 benchmarks/cpu_speed.py --model /tmp/smollm2-q4_k_m.gguf --dtype float32 --batch 1

llama.cpp's Q4_K_M gives ffn_down Q6_K in the layers `use_more_bits` picks and Q4_K elsewhere; every other
tensor of SmolLM2-135M has rows of 576 weights, not whole 256-weight super-blocks, so llama.cpp falls back
to 32-weight types for them: here they keep the default file's Q4_1 and Q8_0 blocks. The K-quant blocks are
written by plain round-to-nearest with min/max and abs-max scales (gguf-py cannot quantize K-quants), from
the Q4_1 file's dequantized values: a timing model, not a quality one. Each tensor's round trip through
gguf's `dequantize` is checked against a bound.
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, dequantize


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[n, k] float32 -> [n, k / 256 * 144] uint8: per 32 weights q * d1 - dm1, q in 0..15."""
    x = weights.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(axis=2), 0.0)
    sub_scale, sub_min = (x.max(axis=2) - low) / 15, -low
    d = (sub_scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (sub_min.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(sub_min / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    d1, dm1 = (d[:, None] * sc)[:, :, None], (dmin[:, None] * m)[:, :, None]
    q = np.clip(np.round((x + dm1) / np.where(d1 > 0, d1, 1)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # sub-blocks 2c (low nibbles) and 2c + 1 (high)
    blocks = np.concatenate([_fp16(d), _fp16(dmin), scales, qs], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[n, k] float32 -> [n, k / 256 * 210] uint8: per 16 weights (q - 32) * d * scale, scale int8."""
    x = weights.reshape(-1, 16, 16).astype(np.float32)
    sub_scale = np.abs(x).max(axis=2) / 31
    d = (sub_scale.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    ds = (d[:, None] * sc)[:, :, None]
    q = (np.clip(np.round(x / np.where(ds != 0, ds, 1)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
                        axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose ffn_down Q4_K_M stores as Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--source", default=None, help="the GGUF to convert (default: the default model)")
    args = parser.parse_args()
    if args.source is None:
        from tokenmill.default_model import default_model_path

        args.source = default_model_path()
    reader = GGUFReader(args.source)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    num_layers = reader.fields[f"{arch}.block_count"].contents()
    writer = GGUFWriter(args.output, arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer's own
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        data, ggml_type = np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type)
        if tensor.name.endswith("ffn_down.weight"):
            values = dequantize(data, ggml_type)
            ggml_type = GGMLQuantizationType.Q6_K if use_more_bits(int(tensor.name.split(".")[1]), num_layers) \
                else GGMLQuantizationType.Q4_K
            data = (quantize_q6_k if ggml_type == GGMLQuantizationType.Q6_K else quantize_q4_k)(values)
            error = np.abs(dequantize(data, ggml_type) - values).max() / np.abs(values).max()
            assert error < (0.05 if ggml_type == GGMLQuantizationType.Q6_K else 0.15), (tensor.name, error)
        counts[ggml_type.name] = counts.get(ggml_type.name, 0) + 1
        writer.add_tensor(tensor.name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.output}: tensors by type {counts}")


if __name__ == "__main__":
    main()
