"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions: the engine's beam search
(engine/beam_search.py, LLM.beam_search's), each step's beams run as requests of their own on the async engine.

As in vLLM, n is the beam width and the n best beams are the choices (best first), ranked by cumulative logprob /
length ** length_penalty; the answer is known only at the end, so a stream gets it whole, one chunk per choice.
Sampling fields have no meaning in a search that takes the most likely tokens: each is a 400 unless left at its
default, rather than ignored; temperature is taken, as vLLM's BeamSearchParams does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tokenmill.engine.beam_search import BeamSearch
from tokenmill.engine.detokenizer import make_detokenizer
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.server.errors import bad_request
from tokenmill.server.openai_protocol import SamplingRequest

BEAM_SEARCH_FIELDS = frozenset({
    "use_beam_search", "length_penalty", "n", "ignore_eos", "max_tokens", "max_completion_tokens", "temperature",
    "seed",
    # what the prompt is and how it is rendered
    "model", "prompt", "messages", "add_special_tokens", "truncate_prompt_tokens", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "tools",
    "tool_choice", "parallel_tool_calls", "echo",
    # how the answer is written and delivered
    "stream", "stream_options", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "return_token_ids", "include_reasoning", "guided_decoding_backend", "request_id", "user", "priority",
    "cache_salt",
})
"""The fields beam search honours (temperature: each step samples its token at it, as vLLM's, but beams are ranked by
the model's own logprobs, see BeamSearchParams; seed: the beams do not depend on it; include_stop_str_in_output:
there are no stop strings); best_of (n only) is checked on its own."""


def _asks_nothing(name: str, value) -> bool:
    """Chat's logprobs false and top_logprobs 0 ask for no logprobs, as leaving them out does (completions' logprobs
    0 asks for the sampled token's: `is False`, not `== 0`)."""
    return (name == "logprobs" and value is False) or (name == "top_logprobs" and value == 0)


def beam_search_params(req: SamplingRequest, max_tokens: int) -> BeamSearchParams:
    """The request's search; a 400 naming the first field it would ignore."""
    for name, info in type(req).model_fields.items():
        value = getattr(req, name)
        if (name not in BEAM_SEARCH_FIELDS and value != info.default and name != "best_of"
                and not _asks_nothing(name, value)):
            raise bad_request(f"{name} is not supported with use_beam_search (the search takes the most likely "
                              f"tokens, n beams wide); leave it out", param=name)
    if req.best_of not in (None, req.n):
        raise bad_request("with use_beam_search, n is the beam width (as in vLLM): leave best_of out",
                          param="best_of")
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty, temperature=req.temperature or 0.0)
    except ValueError as e:
        raise bad_request(str(e), param="temperature" if "temperature" in str(e) else "length_penalty") from e


def run_beam_search(state, request_id: str, prompt: dict, params: BeamSearchParams, decode: SamplingParams,
                    priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
    """One prompt's search; yields a single finished output holding the beams (best first). `decode`: how their
    text is decoded (skip_special_tokens, a reasoning parser's markers kept, ...). Closing it mid-search aborts the
    step under way. With --enable-log-requests the request is logged here, once, not each step's."""
    return state.logged_search(request_id, prompt, params, decode,
                               _search(state, request_id, prompt, params, decode, priority, cache_salt))


async def _search(state, request_id: str, prompt: dict, params: BeamSearchParams, decode: SamplingParams,
                  priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
    engine = state.engine
    prompt_ids = prompt["prompt_token_ids"]
    eos_ids = engine.input_processor.tokenizer_info.eos_token_ids
    search = BeamSearch([prompt_ids], params, eos_ids, engine.max_model_len)
    arrival = time.time()
    while not search.done:
        beams = search.step_prompts()
        streams = state.add_requests(f"{request_id}-beam{search.steps}",
                                     [{"prompt_token_ids": tokens} for _, tokens in beams],
                                     [search.step_params] * len(beams), priority, cache_salt, log=False)
        search.advance(await asyncio.gather(*(_last(stream) for stream in streams)))
    outputs = []
    for index, beam in enumerate(search.results()[0].sequences):
        token_ids = beam.tokens[len(prompt_ids):]
        shown = token_ids[:-1] if beam.finish_reason == "stop" else token_ids  # the EOS's text left out, as vLLM's
        text = ""
        if engine.tokenizer is not None:
            text = make_detokenizer(engine.tokenizer, prompt_ids, decode.skip_special_tokens,
                                    decode.keep_special_token_ids,
                                    decode.spaces_between_special_tokens).update(shown)
        outputs.append(CompletionOutput(index, text, token_ids, beam.finish_reason,
                                        cumulative_logprob=beam.cum_logprob))
    yield RequestOutput(request_id, prompt.get("prompt"), prompt_ids, outputs, True, RequestMetrics(arrival))


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The output of a one-token step (its token's top logprobs)."""
    last = None
    async for output in stream:
        if output.outputs and output.outputs[0].logprobs:
            last = output
    assert last is not None, "a beam's step ends with its token"
    return last
