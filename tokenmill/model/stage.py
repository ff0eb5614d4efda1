"""A pipeline stage's share of a decoder-only model, the same for every family.

Stage s of pp builds only a contiguous range of the decoder layers (`stage_layer_range`); the others are
`OnAnotherStage` placeholders, which hold no weights, so their attention layers have no KV cache here and
the loader skips their checkpoint tensors (`owned_weights`). The first stage also builds the embedding, the
last the final norm and the LM head (and the embedding too when the head shares its weight: one tensor).
With one stage every module is built and `StageLayers.run` is the plain layer loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice

import torch
from torch import nn
from transformers import PretrainedConfig

from tokenmill.distributed.parallel_state import get_pp_stage
from tokenmill.distributed.pipeline import receive_from_previous_stage, send_to_next_stage
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding


class OnAnotherStage(nn.Module):
    """Stands where a module of another pipeline stage would be: no weights, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


def stage_layer_range(num_layers: int, stage: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """[start, end) of the layers `stage` (default: this process's) holds: contiguous and as even as possible,
    the first stages taking one more where the split is uneven (the last one also runs the LM head)."""
    here = get_pp_stage()
    stage = here.stage if stage is None else stage
    num_stages = here.num_stages if num_stages is None else num_stages
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers")
    per_stage, extra = divmod(num_layers, num_stages)
    start = stage * per_stage + min(stage, extra)
    return start, start + per_stage + (stage < extra)


def on_first_stage(make: Callable[[], nn.Module]) -> nn.Module:
    return make() if get_pp_stage().is_first else OnAnotherStage()


def on_last_stage(make: Callable[[], nn.Module]) -> nn.Module:
    return make() if get_pp_stage().is_last else OnAnotherStage()


def make_embedding(config: PretrainedConfig) -> nn.Module:
    """The input embedding: on the first stage, and on the last when the LM head shares its weight."""
    stage = get_pp_stage()
    if stage.is_first or (stage.is_last and config.tie_word_embeddings):
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size)
    return OnAnotherStage()


def make_lm_head(config: PretrainedConfig, embed_tokens: nn.Module, bias: bool = False) -> nn.Module:
    if not get_pp_stage().is_last:
        return OnAnotherStage()
    lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=bias)
    if config.tie_word_embeddings:
        lm_head.tie_to(embed_tokens)
    return lm_head


class StageLayers:
    """This stage's decoder layers, and the step through them between the stages around it.

    `modules` is the model's `layers` ModuleList (every index, so checkpoint names match); a layer takes
    (positions, hidden_states, residual) and returns the new (hidden_states, residual) pair."""

    def __init__(self, config: PretrainedConfig, make_layer: Callable[[int], nn.Module]) -> None:
        num_layers = config.num_hidden_layers
        self.start, self.end = stage_layer_range(num_layers)
        self.modules = nn.ModuleList(make_layer(i) if self.start <= i < self.end else OnAnotherStage()
                                     for i in range(num_layers))
        self.hidden_size = config.hidden_size
        self.dtype = torch.get_default_dtype()  # the loader builds the model under its activation dtype

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
            norm: nn.Module) -> torch.Tensor:
        """The final normed hidden states [num_tokens, hidden_size] on the last stage. Elsewhere the pair goes
        to the next stage and the un-normed hidden states come back (nothing reads them)."""
        stage = get_pp_stage()
        if stage.is_first:
            hidden_states, residual = embed(input_ids), None
        else:
            hidden_states, residual = receive_from_previous_stage(input_ids.shape[0], self.hidden_size, self.dtype,
                                                                  input_ids.device)
        for layer in islice(self.modules, self.start, self.end):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not stage.is_last:
            send_to_next_stage(hidden_states, residual)
            return hidden_states
        hidden_states, _ = norm(hidden_states, residual)
        return hidden_states


def owned_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of modules this stage builds (all of them with one stage)."""
    elsewhere = {name for name, module in model.named_modules() if isinstance(module, OnAnotherStage)}
    if not elsewhere:
        return weights
    return _skip_under(weights, elsewhere)


def _skip_under(weights: Iterable[tuple[str, torch.Tensor]], prefixes: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        parts = name.split(".")
        if not any(".".join(parts[:i]) in prefixes for i in range(1, len(parts))):
            yield name, tensor
