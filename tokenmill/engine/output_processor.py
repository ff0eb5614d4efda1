"""Turn the core's per-step token outputs into RequestOutputs: detokenize, stop strings, metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.protocol import EngineCoreOutput
from tokenmill.request import FinishReason
from tokenmill.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    """Every output carries all text and tokens so far."""
    DELTA = "delta"
    """Every output carries only what is new (for streaming)."""
    FINAL_ONLY = "final_only"
    """Only the finished output is produced."""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    output_kind: OutputKind
    metrics: RequestMetrics
    text: str = ""
    num_text_sent: int = 0
    num_tokens_sent: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.token_ids: list[int] = []


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
    ) -> None:
        detokenizer = None
        if params.detokenize and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detokenizer, output_kind, RequestMetrics(arrival_time)
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver and the ids the core must abort (hit a stop string)."""
        now = time.time()
        results, to_abort = [], []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the caller
            metrics = state.metrics
            if metrics.first_token_time is None and out.new_token_ids:
                metrics.first_token_time = now
            metrics.last_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            state.token_ids.extend(out.new_token_ids)
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None and self._update_text(state, out.new_token_ids):
                to_abort.append(out.request_id)
            result = self._make_output(state, now)
            if result is not None:
                results.append(result)
        return results, to_abort

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests aborted from outside; returns their final outputs."""
        now, results = time.time(), []
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None:
                state.finish_reason = FinishReason.ABORT
                result = self._make_output(state, now)
                if result is not None:
                    results.append(result)
        return results

    def _update_text(self, state: RequestState, new_token_ids: list[int]) -> bool:
        """Append decoded text; True when a stop string ended the request."""
        assert state.detokenizer is not None
        delta = state.detokenizer.update(new_token_ids)
        state.text += delta
        if not delta or not state.params.stop or state.finish_reason is not None:
            return False
        hit = find_stop_string(state.text, len(delta), state.params.stop)
        if hit is None:
            return False
        stop, start = hit
        state.text = state.text[: start + len(stop) if state.params.include_stop_str_in_output else start]
        state.finish_reason, state.stop_reason = FinishReason.STOP, stop
        return True

    def _make_output(self, state: RequestState, now: float) -> RequestOutput | None:
        finished = state.finish_reason is not None
        if finished:
            state.metrics.finished_time = now
            del self.states[state.request_id]
        elif state.output_kind == OutputKind.FINAL_ONLY:
            return None
        if state.output_kind == OutputKind.DELTA:
            text_end = len(state.text) if finished else len(state.text) - self._holdback(state)
            text = state.text[state.num_text_sent : max(text_end, state.num_text_sent)]
            token_ids = state.token_ids[state.num_tokens_sent :]
            state.num_text_sent += len(text)
            state.num_tokens_sent = len(state.token_ids)
        else:
            text, token_ids = state.text, list(state.token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=state.finish_reason.value if finished else None,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )

    @staticmethod
    def _holdback(state: RequestState) -> int:
        """Characters withheld from a stream because they may be the start of a stop string."""
        if not state.params.stop or state.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in state.params.stop) - 1
