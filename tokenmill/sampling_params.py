"""SamplingParams: how one request is sampled and when it stops; validated at the edge.

The fields and their meaning follow vLLM's SamplingParams. The sampler applies them in the order
documented in tokenmill/sample/sampler.py.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""Integers cross to the engine core as 64-bit values; anything wider is refused when validated."""

LogitsProcessor = Callable[..., "object"]
"""fn(output_token_ids, logits_row) -> logits_row, or as vLLM's also fn(prompt_token_ids, output_token_ids,
logits_row). Runs in Python per request: the slow path. (One Callable type: the engine core's msgpack decoder takes
no union of two.)"""

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (torch.finfo(torch.float32).tiny)."""

MAX_LOGIT_BIAS = 1e30
"""Larger, a biased logit divided by the smallest sampling temperature (1e-5) is +inf in float32: the softmax's NaNs
then draw token 0, whatever was biased."""


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    """Every output carries all text and tokens so far."""
    DELTA = "delta"
    """Every output carries only what is new (streaming)."""
    FINAL_ONLY = "final_only"
    """Only the finished output is produced (the offline default)."""


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a structure (vLLM's names); exactly one of these is set. Grammars are
    compiled by xgrammar or llguidance (tokenmill/structured/) and enforced with a token bitmask at every step."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (as a dict or its JSON text): the output is a JSON value that validates against it,
    written compactly unless disable_any_whitespace is false (small models otherwise loop on whitespace)."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF-style, with a `root` rule)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    structural_tag: str | dict[str, Any] | None = None
    """Free text with structured parts, xgrammar's structural tag (as a dict or its JSON text), in vLLM's legacy
    form {"structures": [{"begin", "schema", "end"}], "triggers": [...]} or as a format object
    {"type": "structural_tag", "format": {...}} (tokenmill/structured/structural_tag.py)."""
    reasoning_end: str | None = None
    """When set, the structure applies only after the model has written this marker (a reasoning parser's end
    of thinking, "</think>"): free text up to and including it, then the structure."""
    reasoning_start: str | None = None
    """With reasoning_end, for a model that thinks only where it opens the block itself (Qwen3's "<think>", Granite's
    "Here is my thought process:"): the free text is that block, opened by this marker (after blanks), and an output
    that opens none is the structure from its first token. None: free text up to reasoning_end (the prompt opened
    the block: DeepSeek-R1's)."""
    backend: str | None = None
    """Which library enforces it: "xgrammar", "guidance" (llguidance) or "auto" (xgrammar, llguidance for a JSON
    schema only llguidance enforces whole); None: the engine's structured_outputs_config. Structural tags are
    xgrammar's whatever this says."""
    disable_any_whitespace: bool | None = None
    """JSON (json and json_object) with no whitespace between its tokens; False: any whitespace there; None: the
    engine's structured_outputs_config (True unless set there)."""
    disable_additional_properties: bool | None = None
    """Under llguidance, objects without additionalProperties take only the properties they name (as xgrammar's);
    None: the engine's structured_outputs_config."""
    disable_fallback: bool | None = None
    """Under backend auto, a JSON schema xgrammar would enforce only in part is refused rather than given to
    llguidance; None: the engine's structured_outputs_config."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, grammar, structural_tag "
                             f"or json_object; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs' choice must be a non-empty list of non-empty strings")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise ValueError("structured outputs' reasoning_end must be a non-empty string")
        if self.reasoning_start is not None and (not isinstance(self.reasoning_start, str) or not self.reasoning_start
                                                 or self.reasoning_end is None):
            raise ValueError("structured outputs' reasoning_start must be a non-empty string, with reasoning_end")
        if self.backend not in (None, "auto", "xgrammar", "guidance"):
            raise ValueError(f"structured outputs' backend must be 'auto', 'xgrammar' or 'guidance', got "
                             f"{self.backend!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"structured outputs' {name} must be true, false or None, got "
                                 f"{getattr(self, name)!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar is compiled from, and its cache key."""
        import json

        if self.json is not None:
            # Not sorted: the output writes the properties in the schema's order, as OpenAI's does.
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is not None:
            tag = self.structural_tag
            # Not sorted: the order of a schema's properties is the order they are written in.
            return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)
        return "json_object", ""


@dataclass
class SamplingParams:
    n: int = 1
    """Completions returned for the prompt."""
    best_of: int | None = None
    """Completions generated, of which the n with the highest cumulative logprob are returned."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from every token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted per occurrence of a token already generated."""
    repetition_penalty: float = 1.0
    """transformers' (CTRL): logits of tokens in the prompt or output are divided (if > 0) or
    multiplied (if < 0) by it."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled."""
    bad_words: list[str] | None = None
    """Words never to generate (their last token is masked when the rest was just generated)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens were generated."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the log probabilities of the top `logprobs` tokens (and the sampled one) per step; -1: of every token
    of the vocabulary (as vLLM's, allowed where the engine's max_logprobs is -1)."""
    prompt_logprobs: int | None = None
    """Likewise for each prompt token (the first has none)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (left truncation); -1: as many as the context holds with room for
    output (max_model_len - 1)."""
    skip_special_tokens: bool = True
    keep_special_token_ids: list[int] | None = None
    """Special tokens whose text stays in the output when skip_special_tokens drops the others (the server keeps
    a reasoning parser's <think> and </think>, which some tokenizers make special)."""
    spaces_between_special_tokens: bool = True
    """False: with skip_special_tokens false, an added token right after another comes out without the space some
    decoders (WordPiece's) put between tokens (vLLM's; byte-level BPE and SentencePiece decoders put none)."""
    detokenize: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (logprobs are then those of the
    constrained distribution: the bitmask is applied before everything else). The output ends where the structure
    does: ignore_eos and min_tokens are refused with it."""
    thinking_token_budget: int | None = None
    """At most this many generated tokens inside reasoning blocks (from the engine's reasoning_config start marker,
    `<think>`, to its end marker), over the whole output; once they are spent, the end marker is forced token by
    token (vLLM's). A prompt that ends inside a block starts the count there. None (or -1): no limit."""

    # Token ids of bad_words, filled by the input processor (it owns the tokenizer).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Token ids of the engine's reasoning markers, for thinking_token_budget; filled by the input processor too.
    thinking_start_token_ids: list[int] = field(default_factory=list, repr=False)
    thinking_end_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
               f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if isinstance(self.bad_words, str):  # one word, as stop takes one string (iterated, each letter was banned)
            self.bad_words = [self.bad_words]
        _check(self.bad_words is None or isinstance(self.bad_words, (list, tuple))
               and all(isinstance(w, str) for w in self.bad_words),
               f"bad_words must be a string or a list of strings, got {self.bad_words!r:.200}")
        # Each id once, in order: a client may send the body limit's worth of repeats, and every step reads them.
        self.stop_token_ids = list(dict.fromkeys(as_token_ids(self.stop_token_ids or [], "stop_token_ids")))
        if self.keep_special_token_ids is not None:
            self.keep_special_token_ids = as_token_ids(self.keep_special_token_ids, "keep_special_token_ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(as_token_ids(self.allowed_token_ids, "allowed_token_ids")))
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if isinstance(self.structured_outputs, dict):  # as JSON gives it: it failed at the request's validation
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
               f"got {self.structured_outputs!r:.200}")
        if self.logit_bias:
            # Keys as JSON gives them (strings) or ints; int(1.5) would bias token 1.
            keys = as_token_ids([int(k) if isinstance(k, str) else k for k in self.logit_bias], "logit_bias keys")
            self.logit_bias = {k: float(v) for k, v in zip(keys, self.logit_bias.values())}
        self.validate()

    def validate(self) -> None:
        for name in ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens", "thinking_token_budget"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, numbers.Integral), f"{name} must be an integer, got {value!r}")
            _check(value is None or INT64_MIN <= value <= INT64_MAX, f"{name} must fit in 64 bits, got {value}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)  # a string failed in a comparison below, the field unnamed
            _check(isinstance(value, numbers.Real), f"{name} must be a number, got {value!r}")
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        if self.best_of is not None:
            _check(self.best_of >= self.n, f"best_of ({self.best_of}) must be at least n ({self.n})")
        _check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        # The penalty divides logits in float32: below its smallest normal number it is 0 there (every logit inf).
        _check(self.repetition_penalty >= FLOAT32_TINY,
               f"repetition_penalty must be positive (at least {FLOAT32_TINY:.3g}), got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(self.stop), "stop strings must be non-empty")
        _check(self.logprobs is None or self.logprobs >= -1,
               f"logprobs must be non-negative or -1 (the whole vocabulary), got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= -1,
               f"prompt_logprobs must be non-negative or -1 (the whole vocabulary), got {self.prompt_logprobs}")
        _check(self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
               f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")
        _check(self.thinking_token_budget is None or self.thinking_token_budget >= 0,
               f"thinking_token_budget must be non-negative or -1 (no limit), got {self.thinking_token_budget}")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids must not be empty")
        # NaN would win every greedy step (argmax takes it for the largest) and +inf turns the softmax into NaNs;
        # -inf bans a token.
        _check(not any(math.isnan(v) or v > MAX_LOGIT_BIAS for v in (self.logit_bias or {}).values()),
               f"logit_bias values must be numbers of at most {MAX_LOGIT_BIAS:g}, got {self.logit_bias!r:.200}")
        if self.best_of is not None and self.best_of > self.n and self.is_greedy:
            raise ValueError("best_of > n needs sampling (temperature > 0): greedy samples would all be equal")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """How many sequences are generated for the prompt."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """stop_token_ids for the check of every sampled token (a list's `in` would read a long one each time)."""
        return frozenset(self.stop_token_ids)

    @property
    def bans_tokens(self) -> bool:
        """Whether allowed_token_ids or a -inf logit_bias ban tokens at every position (bad_words and min_tokens
        ban by position)."""
        return self.allowed_token_ids is not None or float("-inf") in (self.logit_bias or {}).values()

    def clone_for_sample(self, index: int) -> SamplingParams:
        """The params of one of several samples: n=1, and a seed of its own if seeded."""
        # Wrapped into 64 bits, so a seed near the top of the range gives every sample a valid seed.
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % (1 << 64) + INT64_MIN
        return replace(self, n=1, best_of=None, seed=seed)


def as_token_ids(ids, name: str) -> list[int]:
    """As plain ints (numpy's too); a float would be truncated to another token where the ids index."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name} must be a list of integers, got {ids!r:.200}") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    """Finished beams are ranked by cumulative logprob / length ** length_penalty."""
    temperature: float = 0.0
    """Each step's token is sampled at this temperature and joins the candidates (as vLLM's), but beams are ranked by
    the model's own logprobs (raw, as returned logprobs are): a sampled token outside its beam's top 2 * beam_width is
    outranked by them, so the beams are those of temperature 0."""

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, numbers.Integral) and value >= 1,
                   f"{name} must be a positive integer, got {value!r}")
        _check(math.isfinite(self.length_penalty), f"length_penalty must be a finite number, got {self.length_penalty}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a non-negative number, got {self.temperature}")
