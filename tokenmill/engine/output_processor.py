"""Turn the core's per-step token outputs into RequestOutputs: detokenize, stop strings, logprobs,
metrics, and the merging of parallel samples (n > 1, best_of) into one output per request.

A request with n > 1 (or best_of) runs in the core as one sample request per completion; their
prompts share KV blocks through the prefix cache. This module gathers them back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, find_stop_string, make_detokenizer
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.protocol import EngineCoreOutput
from tokenmill.request import FinishReason
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.scheduler.output import TokenLogprobs


@dataclass
class ParentRequest:
    """What the caller sees as one request: its prompt, metrics and the samples that make it up."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class SampleState:
    """One completion being generated: a request in the core."""

    request_id: str
    index: int
    parent: ParentRequest
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_text_sent: int = 0
    num_tokens_sent: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.samples: dict[str, SampleState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_kind: RequestOutputKind | None = None,
    ) -> list[tuple[str, SamplingParams]]:
        """Track a request; returns the (core request id, params) of each sample to run."""
        single = params.num_samples == 1
        sample_ids = [request_id] if single else [f"{index}_{request_id}" for index in range(params.num_samples)]
        for used in (request_id, *sample_ids):
            if used in self.parents or used in self.samples:
                raise ValueError(f"request id {used!r} is already in use")
        kind = output_kind or params.output_kind
        if params.num_samples > params.n:
            kind = RequestOutputKind.FINAL_ONLY  # the best n are known only at the end
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, kind, RequestMetrics(arrival_time))
        for index, sample_id in enumerate(sample_ids):
            sample_params = params if single else params.clone_for_sample(index)
            if params.num_samples > params.n and sample_params.logprobs is None:
                # Ranking by cumulative logprob needs the chosen tokens' logprobs.
                sample_params.logprobs = 0
            detokenizer = None
            if params.detokenize and self.tokenizer is not None:
                detokenizer = make_detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.keep_special_token_ids, params.spaces_between_special_tokens)
            sample = SampleState(sample_id, index, parent, sample_params, detokenizer)
            parent.samples.append(sample)
        # Tracked only once all is built: a request tracked and never sent to the core would keep every later
        # LLM.generate() stepping forever, waiting for it.
        self.parents[request_id] = parent
        self.samples.update((s.request_id, s) for s in parent.samples)
        return [(s.request_id, s.params) for s in parent.samples]

    def sample_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request_id for s in parent.samples] if parent else []

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver and the core ids to abort: samples that hit a stop string, and the
        other samples of a request the core refused."""
        now = time.time()
        results, to_abort = [], []
        for out in outputs:
            sample = self.samples.get(out.request_id)
            if sample is None:
                continue  # aborted by the caller
            parent = sample.parent
            if out.finish_reason == FinishReason.ABORT:
                # The core refused this sample (it aborts nothing by itself): the request fails whole.
                siblings = [s.request_id for s in parent.samples if s is not sample and s.finish_reason is None]
                to_abort += siblings
                results += self.abort_requests([parent.request_id])
                continue
            if parent.metrics.first_token_time is None and out.new_token_ids:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            if sample is parent.samples[0]:  # the prompt's: the other samples fork it (all of it "cached" there)
                parent.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is None:
                decode = parent.params.detokenize
                parent.prompt_logprobs = [None] + [self._to_logprob_dict(e, decode) for e in out.new_prompt_logprobs]
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            # A stop token's own text is left out unless include_stop_str_in_output asks for it: EOS too (the core's
            # "stop" is always a token's; stop strings are found here), whose text shows when special tokens do.
            stopped_by_token = out.finish_reason == FinishReason.STOP and not sample.params.include_stop_str_in_output
            text_ids = out.new_token_ids[:-1] if stopped_by_token else out.new_token_ids
            # Several tokens in one step (accepted drafts): a stop string met by one of them ends the sample
            # there, so they are decoded one by one and the tokens after it are dropped.
            pieces = [text_ids] if len(text_ids) < 2 or not sample.params.stop else [[t] for t in text_ids]
            num_kept = len(out.new_token_ids)
            for i, piece in enumerate(pieces):
                # As vLLM: no stop string ends a sample before it has min_tokens output tokens.
                num_output = len(sample.token_ids) + (i + 1 if len(pieces) > 1 else num_kept)
                stops = num_output >= sample.params.min_tokens
                if sample.detokenizer is not None and self._update_text(sample, piece, stops):
                    to_abort.append(out.request_id)
                    num_kept = i + 1 if len(pieces) > 1 else num_kept
                    break
            sample.token_ids.extend(out.new_token_ids[:num_kept])
            if out.new_logprobs is not None:
                for entry in out.new_logprobs[:num_kept]:
                    self._append_logprobs(sample, entry)
            result = self._make_output(sample, now)
            if result is not None:
                results.append(result)
        return results, to_abort

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests aborted from outside (caller ids, not sample ids); returns final outputs."""
        now, results = time.time(), []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is None:
                continue
            outputs = []
            for sample in parent.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = FinishReason.ABORT
                    if (output := self._make_output(sample, now)) is not None:
                        outputs.append(output)
            if outputs:
                final = outputs[-1]
                if parent.output_kind == RequestOutputKind.DELTA:
                    # Each delta holds its one sample: the final output carries every sample's end (else the
                    # consumer and the metrics see only the last sample aborted).
                    final.outputs = [completion for output in outputs for completion in output.outputs]
                results.append(final)
        return results

    # ---- per-sample updates ----------------------------------------------------------------

    def _update_text(self, sample: SampleState, new_token_ids: list[int], stops: bool = True) -> bool:
        """Append decoded text; True when a stop string ended the sample (looked for only if `stops`)."""
        assert sample.detokenizer is not None
        delta = sample.detokenizer.update(new_token_ids)
        sample.text += delta
        # Checked even when this token also ended the sample (max_tokens, stop token): a stop string
        # it completes must still cut the text.
        if not delta or not sample.params.stop or not stops:
            return False
        hit = find_stop_string(sample.text, len(delta), sample.params.stop)
        if hit is None:
            return False
        stop, start = hit
        sample.text = sample.text[: start + len(stop) if sample.params.include_stop_str_in_output else start]
        sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop
        return True

    def _append_logprobs(self, sample: SampleState, entry: TokenLogprobs) -> None:
        sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + entry.logprobs[0]
        if sample.parent.params.logprobs is not None:
            if sample.logprobs is None:
                sample.logprobs = []
            sample.logprobs.append(self._to_logprob_dict(entry, sample.params.detokenize))

    def _to_logprob_dict(self, entry: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        """Chosen token first (with its rank), then the top alternatives ranked 1..k; each token's text unless
        `decode` is off (detokenize=False: as vLLM, no decoded_token, nor the cost of decoding each)."""
        chosen = entry.token_ids[0]
        decode_one = self._decode_one if decode else lambda token_id: None
        result = {chosen: Logprob(entry.logprobs[0], entry.rank, decode_one(chosen))}
        for rank, (token_id, logprob) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            result.setdefault(token_id, Logprob(logprob, rank, decode_one(token_id)))
        return result

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    # ---- what the caller sees --------------------------------------------------------------

    def _make_output(self, sample: SampleState, now: float) -> RequestOutput | None:
        parent = sample.parent
        if sample.finish_reason is not None:
            del self.samples[sample.request_id]
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = now
            del self.parents[parent.request_id]
        if parent.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [self._completion(s, delta=False) for s in self._best(parent)]
        elif parent.output_kind == RequestOutputKind.DELTA:
            completions = [self._completion(sample, delta=True)]
        else:
            completions = [self._completion(s, delta=False) for s in parent.samples]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
        )

    @staticmethod
    def _best(parent: ParentRequest) -> list[SampleState]:
        if parent.params.num_samples == parent.params.n:
            return parent.samples
        # A sample without a token (its constraints left none: "error") ranks last, not as a log-probability of 0.
        ranked = sorted(parent.samples, reverse=True,
                        key=lambda s: -math.inf if s.cumulative_logprob is None else s.cumulative_logprob)
        return ranked[: parent.params.n]

    def _completion(self, sample: SampleState, delta: bool) -> CompletionOutput:
        finished = sample.finish_reason is not None
        text, token_ids, logprobs = sample.text, list(sample.token_ids), sample.logprobs
        if delta:
            text_end = len(sample.text) if finished else len(sample.text) - self._holdback(sample)
            text = sample.text[sample.num_text_sent : max(text_end, sample.num_text_sent)]
            token_ids = sample.token_ids[sample.num_tokens_sent :]
            if logprobs is not None:
                logprobs = logprobs[sample.num_tokens_sent :]
            sample.num_text_sent += len(text)
            sample.num_tokens_sent = len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=token_ids,
            finish_reason=sample.finish_reason.value if finished else None,
            stop_reason=sample.stop_reason,
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=logprobs,
        )

    @staticmethod
    def _holdback(sample: SampleState) -> int:
        """Characters withheld from a stream because they may be the start of a stop string."""
        if not sample.params.stop or sample.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in sample.params.stop) - 1
