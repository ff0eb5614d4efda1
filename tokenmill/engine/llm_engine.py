"""LLMEngine: input processing + an in-process EngineCore + output processing, stepped by the caller."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, PromptType
from tokenmill.engine.output_processor import OutputKind, OutputProcessor
from tokenmill.engine.tokenizer import load_tokenizer, make_tokenizer_info
from tokenmill.model.loader import load_hf_config
from tokenmill.model.registry import get_model_class
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import SchedulerStats
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if model_max is None:
            raise ValueError("the model config has no max_position_embeddings: pass max_model_len")
        return model_max
    if model_max is not None and requested > model_max:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={model_max}")
    return requested


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.hf_config = load_hf_config(model_config)
        get_model_class(self.hf_config.architectures)  # fail fast: before the tokenizer and weights load
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, self.hf_config)
        self.tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config, self.hf_config)
        tokenizer_info = make_tokenizer_info(self.tokenizer, self.hf_config, model_config)
        self.input_processor = InputProcessor(
            self.tokenizer, tokenizer_info, self.max_model_len, self.hf_config.vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.core = EngineCore(config, self.hf_config, self.max_model_len)
        self._request_counter = itertools.count()
        self.last_stats: SchedulerStats | None = None

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: OutputKind | None = None,
    ) -> None:
        text, request = self.input_processor.process(request_id, prompt, params, priority, cache_salt)
        samples = self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, params, request.arrival_time, output_kind
        )
        for sample_id, sample_params in samples:
            self.core.add_request(replace(request, request_id=sample_id, sampling_params=sample_params))

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.core.abort_requests([sid for rid in request_ids for sid in self.output_processor.sample_ids(rid)])
        return self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        if core_outputs.scheduler_stats is not None:
            self.last_stats = core_outputs.scheduler_stats
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
