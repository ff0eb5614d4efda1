"""LLMEngine: input processing + an in-process EngineCore + output processing, stepped by the caller."""

from __future__ import annotations

import itertools

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.frontend import load_frontend
from tokenmill.engine.input_processor import PromptType
from tokenmill.outputs import RequestOutput
from tokenmill.protocol import SchedulerStats
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size {config.parallel_config.data_parallel_size}: engine replicas run "
                             "behind the server only (`tokenmill serve -dp N`); the offline LLM runs one engine "
                             "(start one LLM per process and device set instead)")
        self.config = config
        self.frontend = frontend = load_frontend(config.model_config,
                                                 structured_outputs=config.structured_outputs_config,
                                                 reasoning=config.reasoning_config)
        self.hf_config, self.max_model_len = frontend.hf_config, frontend.max_model_len
        self.tokenizer = frontend.tokenizer
        self.input_processor, self.output_processor = frontend.input_processor, frontend.output_processor
        self.core = EngineCore.from_config(config, self.hf_config, self.max_model_len)
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
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        requests = self.frontend.prepare(request_id, prompt, params, priority, cache_salt, output_kind)
        added: list[str] = []
        try:
            for request in requests:
                self.core.add_request(request)
                added.append(request.request_id)
        except Exception:
            # All or nothing: no sample may run for a request the caller was told failed.
            self.core.abort_requests(added)
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.core.abort_requests([sid for rid in request_ids for sid in self.output_processor.sample_ids(rid)])
        return self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        try:
            core_outputs = self.core.step()
        except BaseException:
            # The core ended the failed step's requests without outputs: every request ends here too (they are all
            # the call's that drives the steps), so that the engine is idle and serves the next call.
            self.abort_request(list(self.output_processor.parents))
            raise
        if core_outputs.scheduler_stats is not None:
            self.last_stats = core_outputs.scheduler_stats
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
