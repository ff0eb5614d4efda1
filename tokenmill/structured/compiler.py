"""Grammar compilation against the model's vocabulary, in a thread pool, cached per spec.

Compiling a JSON schema takes milliseconds to seconds; the engine core submits a request's grammar when
the request arrives and schedules the request only once it is compiled, so the batch never waits for it.
Requests with the same spec share one compilation (and xgrammar's own cache shares sub-grammars).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import build_grammar
from tokenmill.structured.matcher_set import half_the_usable_cpus
from tokenmill.structured.vocab import grammar_vocab_size

logger = logging.getLogger(__name__)

MAX_CACHED = 1024
"""Distinct specs kept compiled; beyond it the oldest are forgotten (recompiled if asked again)."""
MAX_COMPILE_THREADS = 8


def compile_threads() -> int:
    """Grammars compiled at once: xgrammar releases the GIL while it compiles, so a burst of new schemas (each
    ~10 ms) compiles as fast as there are cores; half this process's CPUs (the engine's loop, the grammar process
    and the fills need the rest), at least 2, at most 8."""
    return max(2, min(MAX_COMPILE_THREADS, half_the_usable_cpus()))


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, num_threads: int | None = None) -> None:
        """`load_tokenizer`: the model's Hugging Face tokenizer, loaded in a compile thread on first use;
        `num_threads`: grammars compiled at once (None: compile_threads())."""
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(num_threads or compile_threads(), thread_name_prefix="grammar")
        self._lock = Lock()
        self._compiler = None
        self._compiled: dict[tuple[str, str, str], Future] = {}
        self._listeners: list[Callable[[StructuredOutputsParams], None]] = []

    def __reduce__(self):
        # Sent to another process (a tensor-parallel rank) as its recipe: a compiler of its own, which needs
        # `load_tokenizer` to be picklable (a functools.partial, not a lambda).
        return type(self), (self._load_tokenizer, self._vocab_size, self._pool._max_workers)

    def add_listener(self, listener: Callable[[StructuredOutputsParams], None]) -> None:
        """`listener(spec)` at each spec this compiler starts on (a grammar process compiling its own copy)."""
        self._listeners.append(listener)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of a spec (a future: done at once when the spec was compiled before)."""
        key = (*params.key, params.reasoning_end or "")
        with self._lock:
            future = self._compiled.get(key)
            is_new = future is None
            if is_new:
                if len(self._compiled) >= MAX_CACHED:
                    self._compiled.pop(next(iter(self._compiled)))
                future = self._compiled[key] = self._pool.submit(self._compile, params)
        if is_new:
            for listener in self._listeners:
                listener(params)
        return future

    def get(self, params: StructuredOutputsParams):
        """A compiled grammar; blocks if it is still compiling."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                tokenizer = self._load_tokenizer()
                vocab_size = grammar_vocab_size(tokenizer, self._vocab_size)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
            compiler = self._compiler
        return compiler.compile_grammar(build_grammar(params))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
