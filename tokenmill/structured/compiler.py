"""Grammar compilation against the model's vocabulary, in a thread pool, cached per spec.

Compiling a JSON schema takes milliseconds to seconds; the engine core submits a request's grammar when
the request arrives and schedules the request only once it is compiled, so the batch never waits for it.
Requests with the same spec share one compilation (and xgrammar's own cache shares sub-grammars).

When a grammar process holds the matchers (structured/grammar_process.py), it compiles every grammar it needs
anyway: the compiler it was given then `delegate`s, so that each spec compiles once, there, and the grammar
process reports when it is ready (or failed). In a one-process engine that compiler is the engine core's own, so
the core's readiness comes from the grammar process and this process compiles nothing. A worker in another
process (multi-process and tensor-parallel executors) gets a copy of its own (pickled as its recipe), which its
grammar process takes over: the engine core's compiler compiles for readiness as before there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import build_grammar
from tokenmill.structured.guidance import GUIDANCE, GuidanceGrammar, compile_guidance, is_special_end, make_tokenizer
from tokenmill.structured.matcher_set import half_the_usable_cpus
from tokenmill.structured.vocab import grammar_vocab_size

SpecKey = tuple[str, ...]

logger = logging.getLogger(__name__)

MAX_CACHED = 1024
"""Distinct specs kept compiled; beyond it the oldest are forgotten (recompiled if asked again)."""
MAX_COMPILE_THREADS = 8


def compile_threads() -> int:
    """Grammars compiled at once: xgrammar releases the GIL while it compiles, so a burst of new schemas (each
    ~10 ms) compiles as fast as there are cores; half this process's CPUs (the engine's loop, the grammar process
    and the fills need the rest), at least 2, at most 8."""
    return max(2, min(MAX_COMPILE_THREADS, half_the_usable_cpus()))


def spec_key(params: StructuredOutputsParams) -> SpecKey:
    """What makes two specs compile alike."""
    return (*params.key, params.reasoning_end or "", params.reasoning_start or "", params.backend or "",
            str(params.disable_any_whitespace), str(params.disable_additional_properties))


def compiled_vocab_size(compiled) -> int:
    """The vocabulary a compiled grammar's masks cover (xgrammar's or llguidance's)."""
    return compiled.vocab_size if isinstance(compiled, GuidanceGrammar) else compiled.tokenizer_info.vocab_size


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, num_threads: int | None = None) -> None:
        """`load_tokenizer`: the model's Hugging Face tokenizer, loaded in a compile thread on first use;
        `num_threads`: grammars compiled at once (None: compile_threads())."""
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(num_threads or compile_threads(), thread_name_prefix="grammar")
        self._lock = Lock()
        self._compiler = None
        self._tokenizer = None  # the Hugging Face tokenizer, loaded at the first compile
        self._guidance_tokenizer = None  # llguidance's, made at the first of its grammars (~1 s)
        self._compiled: dict[SpecKey, Future] = {}
        self.grammar_vocab_size: int | None = None
        """The grammars' vocabulary (structured/vocab.py), the masks' width: known once a grammar compiled."""
        self.num_compiled = 0
        """Grammars compiled in this process (none while a grammar process compiles them: `delegate`)."""
        self._compile_elsewhere: Callable[[StructuredOutputsParams], None] | None = None
        self._elsewhere: dict[SpecKey, Future] = {}  # compiling elsewhere: resolved by `compiled`, cached or not
        self._elsewhere_gone: BaseException | None = None

    def __reduce__(self):
        # Sent to another process (a tensor-parallel rank) as its recipe: a compiler of its own, which needs
        # `load_tokenizer` to be picklable (a functools.partial, not a lambda).
        return type(self), (self._load_tokenizer, self._vocab_size, self._pool._max_workers)

    def delegate(self, compile_elsewhere: Callable[[StructuredOutputsParams], None]) -> None:
        """Compile nothing here from now on: `compile_elsewhere(spec)` (called from the submitting thread)
        starts each new spec elsewhere (or raises: its future fails), whose end `compiled` reports, or
        `elsewhere_gone` for all those pending. The futures' results are then None: `get` refuses."""
        self._compile_elsewhere = compile_elsewhere

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of a spec (a future: done at once when the spec was compiled before)."""
        key = spec_key(params)
        start_elsewhere = False
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                if len(self._compiled) >= MAX_CACHED:
                    self._compiled.pop(next(iter(self._compiled)))
                if self._compile_elsewhere is None:
                    future = self._pool.submit(self._compile, params)
                else:
                    future = self._elsewhere.get(key)  # forgotten by the cache, still compiling
                    if future is None:
                        future = Future()
                        if self._elsewhere_gone is not None:
                            future.set_exception(self._elsewhere_gone)
                        else:
                            self._elsewhere[key] = future
                            start_elsewhere = True
                self._compiled[key] = future
        if start_elsewhere:
            try:
                self._compile_elsewhere(params)
            except Exception as error:  # the request fails, not the caller
                self.compiled(key, error)
        return future

    def get(self, params: StructuredOutputsParams):
        """A compiled grammar; blocks if it is still compiling."""
        if self._compile_elsewhere is not None:
            raise RuntimeError("this compiler's grammars are compiled in a grammar process (`delegate`)")
        return self.submit(params).result()

    def compiled(self, key: SpecKey, error: BaseException | str | None, vocab_size: int | None = None) -> None:
        """A spec compiled elsewhere is ready (`error` None; the grammars' vocabulary `vocab_size`), or failed
        (`error`: the exception or its text)."""
        with self._lock:
            future = self._elsewhere.pop(key, None)
            if error is None and vocab_size is not None:
                self.grammar_vocab_size = vocab_size
        if future is None:
            logger.warning("a grammar compiled elsewhere that nothing waits for: %s", key[0])
        elif error is None:
            future.set_result(None)
        else:
            future.set_exception(error if isinstance(error, BaseException) else RuntimeError(error))

    def elsewhere_gone(self, error: BaseException) -> None:
        """Whatever compiled the grammars is gone: the pending ones fail with `error`, and every new one."""
        with self._lock:
            self._elsewhere_gone = error
            pending, self._elsewhere = self._elsewhere, {}
        for future in pending.values():
            future.set_exception(error)

    def _compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a spec, by its backend (None, as a spec the frontend did not resolve: xgrammar)."""
        import xgrammar as xgr

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
                self.grammar_vocab_size = grammar_vocab_size(self._tokenizer, self._vocab_size)
            self.num_compiled += 1
            if params.backend == GUIDANCE:
                if self._guidance_tokenizer is None:
                    self._guidance_tokenizer = make_tokenizer(self._tokenizer, self.grammar_vocab_size)
                tokenizer = self._guidance_tokenizer
                # Under the lock: the Hugging Face tokenizer is not thread-safe.
                special_end = is_special_end(params, tokenizer, self._tokenizer)
            elif self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.grammar_vocab_size)
                # One thread per grammar: the pool compiles several at once, and xgrammar's own threads (8 by
                # default) made no grammar faster here, only a burst slower (BENCHMARKS.md, structured outputs).
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            compiler = self._compiler
        if params.backend == GUIDANCE:
            return compile_guidance(params, tokenizer, special_end)
        return compiler.compile_grammar(build_grammar(params))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
