"""Gather one request's DELTA outputs into whole choices (for non-streamed responses)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChoiceGatherer:
    """A request's DELTA outputs added up into whole choices."""

    def __init__(self, params: SamplingParams) -> None:
        # With best_of > n the engine sends only the final output, whole, holding the n best samples.
        self.is_delta = params.num_samples == params.n
        self._choices: dict[int, Choice] = {}
        self.last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        self.last = output
        for position, completion in enumerate(output.outputs):
            index = completion.index if self.is_delta else position
            choice = self._choices.setdefault(index, Choice())
            choice.text += completion.text
            choice.token_ids += completion.token_ids
            if completion.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + completion.logprobs
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason

    def choices(self) -> list[Choice]:
        """In index order."""
        return [self._choices[i] for i in sorted(self._choices)]


async def collect(stream: AsyncIterator[RequestOutput], params: SamplingParams) -> tuple[RequestOutput, list[Choice]]:
    """The last output (prompt, prompt logprobs) and the request's choices in index order."""
    gatherer = ChoiceGatherer(params)
    async for output in stream:
        gatherer.add(output)
    assert gatherer.last is not None, "a request stream ends with a finished output"
    return gatherer.last, gatherer.choices()
