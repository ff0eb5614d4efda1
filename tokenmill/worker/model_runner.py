"""ModelRunner: one scheduled step -> forward pass -> sampled tokens.

This file must only contain the path common to every model and request: update the persistent
request rows, build inputs, run the model under the step's forward context, sample. Rarer
features belong in their own modules behind these calls.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.forward_context import forward_context
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler
from tokenmill.scheduler.output import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.input_batch import InputBatch, prepare_inputs
from tokenmill.worker.request_state import RequestStates


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        max_blocks_per_req = -(-max_model_len // block_size)
        self.states = RequestStates(max_num_reqs, max_model_len, max_blocks_per_req)
        self.sampler = Sampler()
        self._seeded_generators: dict[int, torch.Generator] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = prepare_inputs(scheduler_output, self.states, self.block_size)
        hidden_states = self._forward(batch)
        if len(batch.sampled_rows) == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden_states[self._to_device(batch.logits_indices)])
        token_ids = self.sampler(logits, self._sampling_metadata(batch.sampled_rows)).tolist()
        sampled: dict[str, int] = {}
        rows_to_ids = {row: rid for rid, row in zip(batch.request_ids, batch.rows.tolist())}
        for row, token_id in zip(batch.sampled_rows.tolist(), token_ids):
            self.states.append_token(row, token_id)
            sampled[rows_to_ids[row]] = token_id
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        metadata = self.attn_backend.build_metadata(batch.layout, self.device)
        with forward_context(self.attn_backend, metadata):
            return self.model(self._to_device(batch.input_ids), self._to_device(batch.positions))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        params = [self.states.sampling_params[row] for row in rows.tolist()]
        generators = {}
        for i, (row, p) in enumerate(zip(rows.tolist(), params)):
            if p.seed is not None and not p.is_greedy:
                # Reseeded from (seed, position) every step: the draw depends on nothing else, so
                # batch composition and preemption cannot change a seeded request's tokens.
                generator = self._seeded_generators.setdefault(i, torch.Generator(self.device))
                num_output = int(self.states.num_tokens[row] - self.states.num_prompt_tokens[row])
                generator.manual_seed(hash((p.seed, num_output)) & ((1 << 63) - 1))
                generators[i] = generator
        return SamplingMetadata.build(params, generators, self.vocab_size, self.device)
