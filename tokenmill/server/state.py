"""What every route shares: the engine, the server config, the served model name; the checks every
generation request goes through before it reaches the engine (model name, overload)."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.input_processor import PromptType
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.server.choices import ChoiceGatherer
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.logprobs import Decode, token_id_text
from tokenmill.server.openai_protocol import SamplingRequest
from tokenmill.server.sampling import field_named
from tokenmill.server.structured_outputs import GrammarChecker

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
LONG_TEXT_CHARS = 100_000
"""Text from this many characters up (~0.1 s of tokenization, a 2-million-character prompt ~1.4 s) is tokenized
on a thread of its own, so that it holds up no other request's tokenization."""

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    max_num_seqs: int
    also_served_as: tuple[str, ...] = ()
    """Further names requests may give (--served-model-name's after the first, which responses carry)."""
    sampling_defaults: dict = field(default_factory=dict)
    """Sampling parameters' values for requests that leave them unset (--generation-config)."""
    tokenizer_executor: ThreadPoolExecutor = field(
        # One thread: a Rust tokenizer used from several threads at once can fail ("Already borrowed").
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer"),
    )
    long_text_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="long-text-tokenizer"),
    )
    """Long texts' tokenization, with a copy of the tokenizer of its own (the one thread's above is not shared)."""
    _long_text_tokenizer: object = field(default=None, init=False, repr=False)
    grammar_checker: GrammarChecker = field(default_factory=GrammarChecker)
    """Structured outputs' schemas, regexes and grammars are checked on a thread of their own."""
    _vocab_bytes: list[bytes] | None = field(default=None, init=False, repr=False)
    server_load: int = field(default=0, init=False)
    """Completions and chat completions in flight, counted with --enable-server-load-tracking (GET /load)."""

    async def off_loop(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the tokenizer thread: chat templates and tokenization of long prompts
        take long enough to stall every other stream if run on the event loop."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, call)

    async def tokenize(self, fn: Callable[..., T], /, *args, text_chars: int, **kwargs) -> T:
        """fn(tokenizer, *args, **kwargs) off the event loop: on the tokenizer thread with the engine's tokenizer,
        or, for `text_chars` of LONG_TEXT_CHARS and more, on the long texts' thread with its own copy, so that a
        huge prompt (seconds, even when it ends in a 400 for its length) holds up nobody else's."""
        if text_chars < LONG_TEXT_CHARS:
            return await self.off_loop(fn, self.engine.tokenizer, *args, **kwargs)
        if self._long_text_tokenizer is None:
            # Copied on first use (a 128k vocabulary: ~0.1 s) on the tokenizer thread, where nothing else uses the
            # original meanwhile.
            self._long_text_tokenizer = await self.off_loop(copy.deepcopy, self.engine.tokenizer)
        call = functools.partial(fn, self._long_text_tokenizer, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.long_text_executor, call)

    async def vocab_bytes(self) -> list[bytes] | None:
        """Each token id's own bytes (chat logprobs' `bytes`), read from the tokenizer on first use (~0.1 s for a 49k
        vocabulary, on the tokenizer thread); None without a tokenizer."""
        if self._vocab_bytes is None and self.engine.tokenizer is not None:
            self._vocab_bytes = await self.off_loop(_vocab_bytes, self.engine.tokenizer)
        return self._vocab_bytes

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.also_served_as)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(f"'{n}'" for n in self.model_names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served}",
                           code="model_not_found", param="model")

    def check_capacity(self, num_new_seqs: int) -> None:
        """503 when admitting `num_new_seqs` more sequences would leave too many waiting."""
        limit = self.config.max_waiting_requests
        if limit < 0:  # disabled
            return
        engine = self.engine
        # Beyond max_num_seqs sequences wait for sure; when the core already has some waiting (a
        # full KV cache), new ones queue behind them.
        waiting = engine.get_num_unfinished_seqs() + num_new_seqs - self.max_num_seqs
        if engine.last_stats is not None and engine.last_stats.num_waiting_reqs > 0:
            waiting = max(waiting, engine.last_stats.num_waiting_reqs + num_new_seqs)
        if waiting > limit:
            raise APIError(503, f"the server is overloaded ({limit} requests already wait); retry later",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})

    def add_requests(
        self, request_id: str, prompts: list[PromptType], params: list[SamplingParams], priority: int,
        cache_salt: str | None, log: bool = True,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Enqueue one engine request per prompt, all or none (400 if the engine refuses one). log: False for the
        steps of a request logged as a whole (a beam search's, see logged_search)."""
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        streams = []
        if log and self.config.enable_log_requests:
            for rid, prompt, p in zip(ids, prompts, params):
                self._log_request(rid, prompt, p)
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                streams.append(self.engine.add_request(rid, prompt, p, priority, cache_salt))
            if log and self.config.enable_log_outputs:
                streams = [self._logged_outputs(rid, s, p) for rid, s, p in zip(ids, streams, params)]
        except BaseException as e:
            # Whatever failed, no part of the request stays behind (abort ignores ids it does not hold).
            self.engine.abort(ids[: len(streams) + 1])
            if isinstance(e, ValueError):  # the engine's checks: named as the request spells the field
                raise bad_request(str(e), param=field_named(str(e), SamplingRequest)) from e
            raise
        return streams

    def logged_search(self, request_id: str, prompt: PromptType, search: BeamSearchParams, decode: SamplingParams,
                      stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """A beam search's request logged once, with its search's parameters (as vLLM logs it), and its beams once
        they are out (--enable-log-outputs); the one-token requests of its steps are not logged."""
        if self.config.enable_log_requests:
            self._log_request(request_id, prompt, search)
        return self._logged_outputs(request_id, stream, decode) if self.config.enable_log_outputs else stream

    def _logged(self, value):
        """A prompt's or an output's text or token ids as the log shows them: cut to --max-log-len."""
        limit = self.config.max_log_len
        return value if value is None or limit is None else value[:limit]

    def _log_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams) -> None:
        text, token_ids = (prompt.get("prompt"), prompt.get("prompt_token_ids")) if isinstance(prompt, dict) else (
            prompt, None)
        logger.info("request %s: prompt %r, prompt_token_ids %s, params %s", request_id, self._logged(text),
                    self._logged(token_ids), params)

    async def _logged_outputs(self, request_id: str, stream: AsyncIterator[RequestOutput],
                              params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The stream as it is, and each choice's whole output logged once it has finished (streamed or not,
        one line a choice rather than one a chunk)."""
        gatherer = ChoiceGatherer(params)
        async with aclosing(stream):  # a consumer that leaves early aborts the request, as without the log
            async for output in stream:
                gatherer.add(output)
                yield output
        for index, choice in enumerate(gatherer.choices()):
            logger.info("request %s output %d: %r, output_token_ids %s, finish_reason %s", request_id, index,
                        self._logged(choice.text), self._logged(choice.token_ids), choice.finish_reason)

    def token_namer(self, req: SamplingRequest) -> Decode:
        """How the request's logprobs name tokens: by id (--return-tokens-as-token-ids, or the request's own
        return_tokens_as_token_ids), else by their text."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids is None:
            as_ids = self.config.return_tokens_as_token_ids
        return token_id_text if as_ids else self.decode_token

    def decode_token(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else token_id_text(token_id)


def _vocab_bytes(tokenizer) -> list[bytes]:
    # xgrammar (already what structured outputs use) knows each vocabulary kind's byte encoding: byte-level BPE,
    # SentencePiece's <0xNN> byte fallback, raw.
    import xgrammar as xgr

    try:
        return xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab
    except Exception as e:  # a vocabulary xgrammar cannot read: each token's text's UTF-8, as before
        logger.warning("token bytes unavailable for chat logprobs (%s: %s)", type(e).__name__, e)
        return []


def make_request_ids(prefix: str, headers: Mapping[str, str], request_id: str | None = None) -> tuple[str, str]:
    """(the response's id, the engine's). As vLLM's, the response's is the caller's X-Request-Id when given, else the
    body's request_id, so that its logs and ours name the request alike; the engine's then has a unique part too:
    callers' ids need not be unique, and a taken id would be refused (and its owner aborted by the refusal's
    cleanup)."""
    fresh = uuid.uuid4().hex
    given = headers.get("x-request-id") or request_id
    if not given:
        return f"{prefix}-{fresh}", f"{prefix}-{fresh}"
    return f"{prefix}-{given}", f"{prefix}-{given}-{fresh}"
