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
    # Compact unless the spec says otherwise, as xgrammar's (small models otherwise loop on whitespace).
    whitespace = {"whitespace_flexible": params.disable_any_whitespace is False}
    if kind == "json":
        if params.disable_additional_properties:
            text = json.dumps(no_additional_properties(json.loads(text)))  # a copy: the spec's text is kept
        grammar = matcher.grammar_from_json_schema(text, defaults=whitespace)
    elif kind == "json_object":
        grammar = matcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
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
    return _after_reasoning(json.loads(grammar)["grammars"], params.reasoning_end, special_end, params.reasoning_start)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
            "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def no_additional_properties(schema, in_all_of: bool = False):
    """`schema` (parsed, changed in place) with additionalProperties false on each object schema that says nothing
    of additional or unevaluated properties (disable_additional_properties): llguidance otherwise lets the model
    add properties the schema does not name, which xgrammar does not. Only schemas are visited, not the data of
    enum, const or default. allOf's own branches are left as they are: each would forbid the others' properties."""
    if not isinstance(schema, dict):
        return schema
    types = schema.get("type")
    is_object = ("object" in types if isinstance(types, list) else types == "object" if types is not None
                 else "properties" in schema)
    if (is_object and not in_all_of and "additionalProperties" not in schema
            and "unevaluatedProperties" not in schema):
        schema["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for child in schema[key].values():
                no_additional_properties(child)
    for key in _SCHEMAS:
        no_additional_properties(schema.get(key))
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for child in schema[key]:
                no_additional_properties(child, in_all_of=key == "allOf")
    return schema


def _lark(text: str) -> str:
    """A grammar in Lark (llguidance's own), or GBNF/EBNF (xgrammar's, with `root ::=`) converted to Lark."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises its own errors and plain ones alike
        raise ValueError(f"invalid grammar: {e}") from None


def _after_reasoning(structure: list[dict], end: str, special_end: bool, start: str | None = None) -> str:
    """Free text up to and including `end`, at most two newlines, then the structure's grammars; with `start`, the
    free text is a block it opens (after blanks), or there is none (reasoning_start; a special `end` takes a
    special `start`, as models' marker pairs are)."""
    structure = [dict(structure[0], name="structure"), *structure[1:]]
    opened = "" if start is None else f"(/[ \\t\\n]+/)? {start if special_end else json.dumps(start)} "
    if special_end:
        # A special token is no text: the free text cannot run past it.
        block = f"{opened}TEXT {end} {_NEWLINES}"
        rules = "TEXT: /(.|\\n)*/\n"
    else:
        block = f"{opened}reasoning {_NEWLINES}"
        rules = f"reasoning[lazy]: TEXT {json.dumps(end)}\nTEXT: /(.|\\n)*/\n"
    head = "" if special_end else "%llguidance {}\n"
    body = f"start: {block} @structure\n" if start is None else f"start: ({block})? @structure\n"
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": head + body + rules}, *structure]})


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
    """A spec's llguidance grammar, checked against the tokenizer: what GrammarCompiler returns for it. Its rows'
    matchers are copies of one made here, in the compile: an LLMatcher built from the grammar's text compiles it
    anew (~0.8 ms a JSON schema, 40x xgrammar's matcher), a copy takes ~3 us and shares the lexer's states that
    its siblings have built."""

    def __init__(self, tokenizer, grammar: str) -> None:
        import llguidance

        self.tokenizer = tokenizer  # llguidance's LLTokenizer, shared by all the engine's grammars
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # never advanced: only copied
        if self.matcher.is_error():
            raise ValueError(f"llguidance: {self.matcher.get_error()}")

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
        self.matcher = compiled.matcher.deep_copy()
        self.own_eos = np.array(compiled.tokenizer.eos_tokens, dtype=np.int64)
        self.stop = np.array(sorted(stop_tokens), dtype=np.int64)
        self._stop_set = frozenset(stop_tokens)
        self._ended = False  # a stop token accepted: counts as one token for rollback

    def accept_token(self, token: int) -> bool:
        if self._ended:
            return False
        if token in self._stop_set:
            self._ended = self.matcher.is_accepting()
            return self._ended
        return self.matcher.try_consume_tokens([token]) == 1  # one call; a refused token leaves no error

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, num_tokens: int) -> None:
        if self._ended and num_tokens:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            self.matcher.rollback(num_tokens)


_executor = None


def fill_guidance(matchers: list[GuidanceMatcher], bitmask: np.ndarray, slots: list[int]) -> None:
    """Each matcher's mask into its row of `bitmask` ([n, words] int32, C-contiguous), in parallel threads (without
    the GIL); then the request's stop tokens where llguidance put its own EOS: allowed where the grammar is
    satisfied, else forbidden (for all rows at once: per row, numpy's calls cost more than llguidance's fill)."""
    global _executor
    import llguidance
    import llguidance.numpy

    if _executor is None:
        _executor = llguidance.LLExecutor(max(1, len(os.sched_getaffinity(0)) // 2))
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m.matcher, s) for m, s in zip(matchers, slots)],
                                                 bitmask)
    words = bitmask.shape[1]
    flat = bitmask.reshape(-1).view(np.uint32)
    slots = np.asarray(slots, dtype=np.int64)
    accepting = np.array([m.matcher.is_accepting() for m in matchers], dtype=bool)
    own_eos = _bits([m.own_eos for m in matchers], slots, words)
    np.bitwise_and.at(flat, own_eos[0], ~own_eos[1])
    stop = _bits([m.stop for m, ok in zip(matchers, accepting.tolist()) if ok], slots[accepting], words)
    np.bitwise_or.at(flat, stop[0], stop[1])


def _bits(tokens: list[np.ndarray], rows: np.ndarray, words: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `tokens` (those inside the mask) as places in the flattened [n, words] mask and their bits."""
    counts = np.array([len(t) for t in tokens], dtype=np.int64)
    tokens = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    where = np.repeat(rows, counts) * words + tokens // 32
    inside = tokens < 32 * words
    return where[inside], np.left_shift(np.uint32(1), (tokens[inside] % 32).astype(np.uint32))
