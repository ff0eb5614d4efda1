"""POST /v1/completions: prompts (text, token ids, or lists of either) -> text_completion, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.outputs import RequestOutput
from tokenmill.server.beam_search import beam_search_params, run_beam_search
from tokenmill.server.choices import collect
from tokenmill.server.errors import bad_request, choice_failed, error_body
from tokenmill.server.limits import MAX_SEQUENCES
from tokenmill.server.logprobs import CompletionLogprobs, vllm_prompt_logprobs
from tokenmill.server.openai_protocol import CompletionRequest
from tokenmill.server.sampling import (
    check_combinations,
    refuse_unsupported,
    resolve_max_tokens,
    stream_usage,
    to_sampling_params,
    truncate_prompt,
)
from tokenmill.server.state import ServerState, make_request_ids
from tokenmill.server.streaming import DONE, SSEResponse, cancel_on_disconnect, merge_streams, sse
from tokenmill.server.structured_outputs import constraint_of
from tokenmill.server.usage import Usage


def split_prompts(prompt: str | list) -> list[dict]:
    """One engine prompt per entry: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return [{"prompt": p} for p in prompt]
    return [{"prompt_token_ids": p} for p in prompt]


def tokenize_prompts(tokenizer: PreTrainedTokenizerBase | None, input_processor: InputProcessor,
                     prompts: list[dict], add_special_tokens: bool = True) -> list[dict]:
    tokenized = []
    for prompt in prompts:
        try:
            text, token_ids = input_processor.tokenize_prompt(prompt, tokenizer, add_special_tokens)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), param="prompt") from e
        if not token_ids:  # here, not in the engine's check, which knows no request field to name
            raise bad_request("the prompt is empty", param="prompt")
        tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
    return tokenized


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    state.check_model(req.model)
    check_combinations(req)
    refuse_unsupported(req)
    if req.suffix is not None:
        raise bad_request("suffix is not supported: this server does no fill-in-the-middle", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo=true, which scores the prompt)",
                          param="max_tokens")
    engine = state.engine
    prompts = split_prompts(req.prompt)
    num_samples = req.best_of or req.n
    num_seqs = len(prompts) * num_samples
    if num_seqs > MAX_SEQUENCES:
        raise bad_request(f"{len(prompts)} prompts of {num_samples} samples each make {num_seqs} sequences; "
                          f"one request may start at most {MAX_SEQUENCES}", param="n")
    constraint = constraint_of(req)
    if constraint is not None:
        await state.grammar_checker.check(constraint, state.engine.input_processor)
    prompts = await state.tokenize(tokenize_prompts, engine.input_processor, prompts, req.add_special_tokens,
                                   text_chars=sum(len(p.get("prompt", "")) for p in prompts))
    for prompt in prompts:
        kept = truncate_prompt(prompt["prompt_token_ids"], req.truncate_prompt_tokens, req.max_tokens,
                               engine.max_model_len)
        if len(kept) < len(prompt["prompt_token_ids"]):  # echo then gives the text of the tokens kept
            prompt.update(prompt=None, prompt_token_ids=kept)
    # Echoed logprobs and vLLM's prompt_logprobs come from the same prompt scores: the larger count serves both.
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    params = [
        to_sampling_params(
            req,
            # Scoring alone (max_tokens 0) still runs one step, whose token the responder drops: the prompt's
            # logprobs come with the first sampled token.
            max(1, resolve_max_tokens(req.max_tokens, len(p["prompt_token_ids"]), engine.max_model_len,
                                      "max_tokens", "prompt")),
            logprobs=req.logprobs,
            prompt_logprobs=(-1 if -1 in wanted else max(wanted)) if wanted else None,  # -1: all of them
            structured_outputs=None if constraint is None else constraint.params,
            defaults=state.sampling_defaults,
            max_logprobs=engine.input_processor.max_logprobs,
            vocab_size=engine.input_processor.vocab_size,
        )
        for p in prompts
    ]
    searches = [beam_search_params(req, p.max_tokens) for p in params] if req.use_beam_search else None
    state.check_capacity(num_seqs)
    request_id, engine_request_id = make_request_ids("cmpl", raw.headers, req.request_id)
    if searches is not None:
        streams = [run_beam_search(state, engine_request_id if len(prompts) == 1 else f"{engine_request_id}-{i}",
                                   prompt, search, p, req.priority, req.cache_salt)
                   for i, (prompt, search, p) in enumerate(zip(prompts, searches, params))]
    else:
        streams = state.add_requests(engine_request_id, prompts, params, req.priority, req.cache_salt)
    response = CompletionResponder(state, req, request_id, prompts)
    if req.stream:
        return SSEResponse(response.stream(streams))
    results = await cancel_on_disconnect(raw, asyncio.gather(*(collect(s, p) for s, p in zip(streams, params))))
    if (error := choice_failed(c for _, choices in results for c in choices)) is not None:
        return JSONResponse(error, status_code=400)
    return JSONResponse(response.full(results))


class CompletionResponder:
    def __init__(self, state: ServerState, req: CompletionRequest, request_id: str, prompts: list[dict]) -> None:
        self.req, self.request_id, self.prompts = req, request_id, prompts
        self.scores_only = req.echo and req.max_tokens == 0
        """The prompt's echo alone: the one token sampled (see create_completion) is not part of the answer."""
        self.model_name = state.model_name
        self.tokenizer = state.engine.tokenizer
        self.decode = state.decode_token
        self.name = state.token_namer(req)
        self.created = int(time.time())
        self.usage = Usage(sum(len(p["prompt_token_ids"]) for p in prompts), state.config.enable_prompt_tokens_details)
        self.force_usage = state.config.enable_force_include_usage

    def _prompt_text(self, prompt: dict) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=self.req.skip_special_tokens)

    def _echo_logprobs(self, fmt: CompletionLogprobs, prompt: dict, output: RequestOutput) -> dict:
        token_ids = prompt["prompt_token_ids"]
        return fmt.format(token_ids, output.prompt_logprobs or [None] * len(token_ids))

    def _generated(self, completion) -> tuple[list[int], list]:
        """A completion's token ids and their logprobs entries, as the answer carries them."""
        if self.scores_only:
            return [], []
        return completion.token_ids, completion.logprobs or [None] * len(completion.token_ids)

    def _ending(self, completion) -> dict:
        if self.scores_only and completion.finish_reason == "stop":  # the dropped token was EOS or a stop string
            return {"finish_reason": "length", "stop_reason": None}
        return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    def _token_ids(self, prompt: dict, token_ids: list[int], with_prompt: bool) -> dict:
        """return_token_ids' fields of a choice (or of a chunk of one: the prompt's ids in its first only)."""
        if not self.req.return_token_ids:
            return {}
        fields = {"prompt_token_ids": prompt["prompt_token_ids"]} if with_prompt else {}
        return {**fields, "token_ids": list(token_ids)}

    def _body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices, **extra}

    def full(self, results: list) -> dict:
        req, choices, usage = self.req, [], self.usage
        for prompt_index, (prompt, (last, prompt_choices)) in enumerate(zip(self.prompts, results)):
            usage.saw(last, prompt_index)
            for choice in prompt_choices:
                token_ids, entries = self._generated(choice)
                text, logprobs = ("" if self.scores_only else choice.text), None
                if req.logprobs is not None:
                    fmt = CompletionLogprobs(req.logprobs, self.decode, self.name)
                    logprobs = self._echo_logprobs(fmt, prompt, last) if req.echo else None
                    logprobs = _concat(logprobs, fmt.format(token_ids, entries))
                if req.echo:
                    text = self._prompt_text(prompt) + text
                usage.add(token_ids)
                choice_body = {"index": len(choices), "text": text, "logprobs": logprobs, **self._ending(choice),
                               **self._token_ids(prompt, token_ids, True)}
                if req.prompt_logprobs is not None:
                    choice_body["prompt_logprobs"] = vllm_prompt_logprobs(
                        prompt["prompt_token_ids"], last.prompt_logprobs or [], req.prompt_logprobs, self.decode)
                choices.append(choice_body)
        return self._body(choices, usage=usage.body())

    async def stream(self, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        req, n = self.req, self.req.n
        formats: dict[int, CompletionLogprobs] = {}
        usage = self.usage
        final_usage, every_chunk_usage = stream_usage(req, self.force_usage)
        endings = []
        sent: set[int] = set()  # the choices a chunk went out for
        try:
            # Closed explicitly, so that a client leaving aborts the requests now, not once collected.
            async with aclosing(merge_streams(streams)) as outputs:
                async for prompt_index, output in outputs:
                    prompt = self.prompts[prompt_index]
                    usage.saw(output, prompt_index)
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        first = index not in formats
                        fmt = formats.setdefault(index, CompletionLogprobs(req.logprobs or 0, self.decode, self.name))
                        token_ids, entries = self._generated(completion)
                        text, logprobs = ("" if self.scores_only else completion.text), None
                        if req.logprobs is not None:
                            logprobs = self._echo_logprobs(fmt, prompt, output) if req.echo and first else None
                            logprobs = _concat(logprobs, fmt.format(token_ids, entries))
                        if req.echo and first:
                            text = self._prompt_text(prompt) + text
                        usage.add(token_ids)
                        # A chunk per step with new tokens, even when their text is held back (part of a
                        # character, or maybe a stop string's start): clients count chunks as tokens arriving.
                        if not text and not token_ids and completion.finish_reason is None:
                            continue
                        if completion.finish_reason is not None:
                            endings.append(completion)
                        extra = {"usage": usage.body()} if every_chunk_usage else {}
                        yield sse(self._body([{"index": index, "text": text, "logprobs": logprobs,
                                               **self._ending(completion),
                                               **self._token_ids(prompt, token_ids, index not in sent)}], **extra))
                        sent.add(index)
            if final_usage:
                yield sse(self._body([], usage=usage.body()))
            if (error := choice_failed(endings)) is not None:
                yield sse(error)
        except EngineDeadError as e:
            yield sse(error_body(503, f"the engine is not running: {e}", code="engine_dead"))
        yield DONE


def _concat(first: dict | None, second: dict) -> dict:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}
