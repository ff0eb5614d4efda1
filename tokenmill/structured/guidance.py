"""The llguidance backend: a spec's llguidance grammar, its matcher behind the xgrammar matcher's interface.

llguidance enforces JSON schemas that xgrammar would only partly enforce (minLength/maxLength beside a pattern or a
format, multipleOf on numbers, ...: json_schema_check.py), and refuses with "Unimplemented keys" what it cannot
enforce either. Backend "auto" (StructuredOutputsConfig) takes it for such schemas only; "guidance" for every spec
but structural tags, whose format is xgrammar's own. Its matchers fill the same packed int32 bitmask.

The request's stop tokens are this module's, not llguidance's (whose end of sequence is the tokenizer's one EOS,
built once per engine, ~1 s): the mask allows them where llguidance allows its EOS, the grammar being satisfied.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tokenmill.sampling_params import StructuredOutputsParams

XGRAMMAR, GUIDANCE, AUTO = "xgrammar", "guidance", "auto"
BACKENDS = (AUTO, XGRAMMAR, GUIDANCE)
_NEWLINES = '("\\n" | "\\n\\n")?'  # what models write after the reasoning's end marker, as after_reasoning


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("the guidance backend of structured outputs needs llguidance: pip install llguidance"
                         ) from None
    return llguidance


def guidance_grammar(params: StructuredOutputsParams, special_end: bool = False) -> str:
    """The llguidance grammar of a spec (not checked: `check_guidance`). `special_end`: the reasoning's end marker is
    one special token of the tokenizer (written as one in the grammar: text cannot match it)."""
    kind, text = params.key
    matcher = _llguidance().LLMatcher
    if kind == "json":
        # Compact, as xgrammar's (small models otherwise loop on whitespace).
        grammar = matcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
    elif kind == "json_object":
        grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(text)
    elif kind == "choice":
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    elif kind == "grammar":
        grammar = matcher.grammar_from_lark(_lark(text))
    else:
        raise ValueError(f"structured outputs' {kind} is xgrammar's own format: the guidance backend cannot enforce it")
    if params.reasoning_end is None:
        return grammar
    return _after_reasoning(json.loads(grammar)["grammars"], params.reasoning_end, special_end)


def _lark(text: str) -> str:
    """A grammar in Lark (llguidance's own), or GBNF/EBNF (xgrammar's, with `root ::=`) converted to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises its own errors and plain ones alike
        raise ValueError(f"invalid grammar: {e}") from None


def _after_reasoning(structure: list[dict], end: str, special_end: bool) -> str:
    """Free text up to and including `end`, at most two newlines, then the structure's grammars."""
    structure = [dict(structure[0], name="structure"), *structure[1:]]
    if special_end:
        # A special token is no text: the free text cannot run past it.
        lark = f"start: TEXT {end} {_NEWLINES} @structure\nTEXT: /(.|\\n)*/\n"
    else:
        lark = (f"%llguidance {{}}\nstart: reasoning {_NEWLINES} @structure\n"
                f"reasoning[lazy]: TEXT {json.dumps(end)}\nTEXT: /(.|\\n)*/\n")
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *structure]})


def guidance_error(grammar: str, tokenizer=None) -> str | None:
    """What llguidance finds wrong with `grammar` (its first line: "Unimplemented keys: [...]", a bad regex...), or
    None."""
    message = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    return message.strip().splitlines()[0] if message.strip() else None


def check_guidance(params: StructuredOutputsParams) -> None:
    """ValueError naming what llguidance cannot enforce of the spec, or finds invalid."""
    error = guidance_error(guidance_grammar(params))
    if error is not None:
        raise ValueError(f"invalid {params.key[0]} for the guidance backend (llguidance): {error}")


class GuidanceGrammar:
    """A spec's llguidance grammar, checked against the tokenizer: what GrammarCompiler returns for it."""

    def __init__(self, tokenizer, grammar: str) -> None:
        self.tokenizer = tokenizer  # llguidance's LLTokenizer, shared by all the engine's grammars
        self.grammar = grammar

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def make_tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's tokenizer over the grammars' vocabulary (structured/vocab.py)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def is_special_end(params: StructuredOutputsParams, tokenizer, hf_tokenizer) -> bool:
    """Whether the spec's reasoning end marker is one special token (`guidance_grammar`'s special_end)."""
    if params.reasoning_end is None:
        return False
    ids = hf_tokenizer.encode(params.reasoning_end, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.is_special_token(ids[0])


def compile_guidance(params: StructuredOutputsParams, tokenizer, special_end: bool) -> GuidanceGrammar:
    """The spec's grammar checked against llguidance's `tokenizer`; ValueError naming what llguidance refuses."""
    grammar = guidance_grammar(params, special_end)
    error = guidance_error(grammar, tokenizer)
    if error is not None:
        raise ValueError(f"invalid {params.key[0]} for the guidance backend (llguidance): {error}")
    return GuidanceGrammar(tokenizer, grammar)


class GuidanceMatcher:
    """An llguidance matcher with xgrammar's GrammarMatcher calls (accept_token, is_terminated, rollback), which
    MatcherSet makes. A refused token leaves it as it was (llguidance's own would be in error for good)."""

    def __init__(self, compiled: GuidanceGrammar, stop_tokens: list[int]) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"llguidance: {self.matcher.get_error()}")
        self._own_eos = np.array(compiled.tokenizer.eos_tokens, dtype=np.int64)
        self._stop = np.array(sorted(stop_tokens), dtype=np.int64)
        self._stop_set = frozenset(stop_tokens)
        self._ended = False  # a stop token accepted: counts as one token for rollback

    def accept_token(self, token: int) -> bool:
        if self._ended:
            return False
        if token in self._stop_set:
            self._ended = self.matcher.is_accepting()
            return self._ended
        return self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token)

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, num_tokens: int) -> None:
        if self._ended and num_tokens:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fix_stop_bits(self, mask: np.ndarray) -> None:
        """`mask` (this matcher's int32 row, as llguidance filled it) with the request's stop tokens where
        llguidance put its own EOS: allowed where the grammar is satisfied, else forbidden."""
        accepting = self.matcher.is_accepting()
        for tokens, allowed in ((self._own_eos, False), (self._stop, accepting)):
            tokens = tokens[tokens < 32 * len(mask)]
            words, bits = tokens // 32, (tokens % 32).astype(np.uint32)
            view = mask.view(np.uint32)
            if allowed:
                np.bitwise_or.at(view, words, np.left_shift(np.uint32(1), bits))
            else:
                np.bitwise_and.at(view, words, ~np.left_shift(np.uint32(1), bits))


_executor = None


def fill_guidance(matchers: list[GuidanceMatcher], bitmask: np.ndarray, slots: list[int]) -> None:
    """Each matcher's mask into its row of `bitmask` ([n, words] int32, C-contiguous), in parallel threads (without
    the GIL)."""
    global _executor
    import llguidance
    import llguidance.numpy

    if _executor is None:
        _executor = llguidance.LLExecutor(max(1, len(os.sched_getaffinity(0)) // 2))
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m.matcher, s) for m, s in zip(matchers, slots)],
                                                 bitmask)
    for matcher, slot in zip(matchers, slots):
        matcher.fix_stop_bits(bitmask[slot])
