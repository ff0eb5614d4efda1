"""Vocabulary embedding and LM head, split over tensor-parallel ranks by vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from tokenmill.layers.cpu_lm_head import cpu_logits
from tokenmill.layers.quant.unquantized import dense_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.keeps_ggml_blocks = False  # an LM head's table keeps the GGUF blocks the loader hands it

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)
        blocks = getattr(loaded_weight, "ggml_blocks", None)
        if blocks is not None and self.keeps_ggml_blocks and self.tp_size == 1 and param.dim() == 2:
            param.ggml_blocks = blocks  # type: ignore[attr-defined]  # for layers.cpu_lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        # Ids of other ranks' rows read row 0 and are zeroed: the sum over ranks holds each id's one row.
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; may share its weight with the input embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size)
        self.keeps_ggml_blocks = True
        self.bias = nn.Parameter(torch.zeros(self.shard_size), requires_grad=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        embedding.keeps_ggml_blocks = True  # the shared table loads through the embedding's loader

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type == "cpu":  # the largest GEMM of a decode step: layers.cpu_lm_head
            logits = cpu_logits(hidden_states, self.weight, self.bias)
        else:  # a decode step's few rows take the skinny GEMM on CUDA (Llama-3's 128,256-row head: 339 us against
            # cuBLAS's 374 on an H100), others cuBLAS
            logits = dense_linear(hidden_states, self.weight, self.bias)  # [num_tokens, shard_size]
        # Every rank gets the whole vocabulary's logits (and samples alike): [num_tokens, tp * shard_size].
        logits = tp_all_gather(logits)
        return logits[..., : self.vocab_size]
