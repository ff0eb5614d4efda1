"""The LM head on the CPU: a few rows from the embedding's GGUF blocks, else oneDNN's prepacked GEMM.

A decode step's LM head reads the whole vocabulary's weights for one to a few rows, so memory decides its
time: the default model's table (49,152 x 576, tied to the embedding) is 113 MB in float32 a step, ~8 ms
on one core of the development machine, where oneDNN already streams at ~14 GB/s (a plain C GEMV over the
same float32 rows was 1.1x faster at one row, slower from two: BENCHMARKS.md, issue 23). The GGUF file
holds the same values as Q8_0 blocks, 30 MB. Where the loader kept them beside the dense table (a GGUF
served with its linear weights kept quantized: model.loader.iter_gguf_weights), up to QUANTIZED_ROWS
float32 rows go through the GGUF kernel (layers.quant.gguf_cpu) over those blocks. They mean exactly the
dense table's float32 values (an fp16 scale times an int8 is exact in float32) and the kernel sums their
float32 products, so the logits differ from the dense GEMM's only by float32 rounding in another order.
From ~48 rows oneDNN's tiles win. In bfloat16 (where the loader keeps the blocks: a small model's
"blocks and dense" form) the dense table is 57 MB and the kernel's bfloat16 path loses to oneDNN at every row
count measured (1-64), but its float32 path over the 30 MB of blocks wins at one and two rows: the bfloat16
rows are converted exactly, and the logits differ from oneDNN's by the table's bfloat16 rounding.
"""

from __future__ import annotations

import torch

from tokenmill.layers.cpu_gemm import cpu_linear
from tokenmill.layers.quant.gguf_cpu import KERNEL_TYPES, gguf_gemm_cpu, load_kernel

# Rows up to which the blocks win (one thread, float32, default model: 5.1 against 9.1 ms at 1 row,
# 11.1 against 16.6 at 16, 19.3 against 22.2 at 32, 35.3 against 32.9 at 64).
QUANTIZED_ROWS = 32
# The same for bfloat16 rows (float32 kernel over the blocks against oneDNN's bfloat16 table, AMD development
# machine, one thread: 1.38 against 1.82 ms at 1 row, 1.90 against 2.68 at 2, 2.25 against 2.32 at 4).
BF16_QUANTIZED_ROWS = 2


def quantized_lm_head_applies(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether cpu_logits takes the weight's GGUF blocks for these rows."""
    blocks = getattr(weight, "ggml_blocks", None)
    most_rows = {torch.float32: QUANTIZED_ROWS, torch.bfloat16: BF16_QUANTIZED_ROWS}.get(hidden_states.dtype, 0)
    return (blocks is not None and hidden_states.device.type == "cpu"
            and 0 < hidden_states.numel() // weight.shape[1] <= most_rows
            and blocks.ggml_type in KERNEL_TYPES and blocks.shape[0] == weight.shape[0]
            and not torch.is_grad_enabled() and load_kernel() is not None)


def cpu_logits(
    hidden_states: torch.Tensor,  # [..., hidden_size]
    weight: torch.Tensor,  # [vocab, hidden_size], maybe with `ggml_blocks` [vocab, row_bytes] uint8
    bias: torch.Tensor | None,  # [vocab]
) -> torch.Tensor:
    """hidden_states @ weight.T + bias, as float32 logits [..., vocab]."""
    if quantized_lm_head_applies(hidden_states, weight):
        blocks, k = weight.ggml_blocks, weight.shape[1]
        logits = gguf_gemm_cpu(hidden_states.reshape(-1, k).float().contiguous(), blocks, blocks.ggml_type, k)
        if bias is not None:
            logits += bias
        return logits.reshape(*hidden_states.shape[:-1], -1)
    # Logits in float32 either way: the sampler's argmax over bfloat16 is ~9x slower on the CPU (24 ms at
    # batch 64 against a 1 ms conversion). The AMX kernel writes them so; after oneDNN they are converted.
    return cpu_linear(hidden_states, weight, bias, out_float32=True)
