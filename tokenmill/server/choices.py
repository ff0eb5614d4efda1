"""Gather one request's DELTA outputs into whole choices (for non-streamed responses), and usage."""

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


async def collect(stream: AsyncIterator[RequestOutput], params: SamplingParams) -> tuple[RequestOutput, list[Choice]]:
    """The last output (prompt, prompt logprobs) and the request's choices in index order."""
    # With best_of > n the engine sends only the final output, whole, holding the n best samples.
    is_delta = params.num_samples == params.n
    choices: dict[int, Choice] = {}
    last = None
    async for output in stream:
        last = output
        for position, completion in enumerate(output.outputs):
            index = completion.index if is_delta else position
            choice = choices.setdefault(index, Choice())
            choice.text += completion.text
            choice.token_ids += completion.token_ids
            if completion.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + completion.logprobs
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
    assert last is not None, "a request stream ends with a finished output"
    return last, [choices[i] for i in sorted(choices)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
