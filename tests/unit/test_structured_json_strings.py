"""Length-bounded JSON strings (minLength/maxLength) under tokenmill's grammars: xgrammar 0.2.9 alone lets raw
control characters (U+0000-U+001F) into them, which JSON forbids (structured/grammar.py fixes its grammar).
Random walks with the real tokenizer, each token drawn uniformly among those the mask allows (what a model
with dummy weights does): no allowed token ever holds a control character, and every finished output parses
and validates with jsonschema. No spec's grammar takes a UTF-16 surrogate (xgrammar 0.2.9 takes their three-byte
forms, which are not UTF-8: grammar.valid_characters)."""

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.grammar import build_grammar, validate
from tokenmill.structured.matchers import unpack_bitmask

xgr = pytest.importorskip("xgrammar")

TOKENIZER = Path(__file__).resolve().parents[2] / "benchmarks/models/smollm2-tokenizer"
SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string", "maxLength": 8},
    "name": {"type": "string", "minLength": 2, "maxLength": 12},
    "note": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 10}, {"type": "null"}]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
    "required": ["code", "name", "note", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def control_tokens(tokenizer) -> np.ndarray:
    has = np.array([any(ord(c) < 0x20 for c in tokenizer.decode([i])) for i in range(len(tokenizer))])
    assert has.sum() > 20  # the tokenizer has such tokens: the test can fail
    return has


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool of a one-row bitmask (bit b of word w = token 32 w + b; little-endian words)."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def test_xgrammar_alone_lets_control_characters_into_bounded_strings(tokenizer):
    """Why the fix exists; when an xgrammar release fixes it, this fails and the fix can go."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema('{"type": "string", "maxLength": 8}',
                                                             any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('"')
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(bitmask)
    assert (allowed_tokens(bitmask, len(tokenizer)) & control_tokens(tokenizer)).any()
    assert np.array_equal(allowed_tokens(bitmask, len(tokenizer)), unpack_bitmask(bitmask, len(tokenizer))[0].numpy())


@pytest.mark.parametrize("schema", [{"type": "string", "minLength": 3, "maxLength": 8}, SCHEMA])
def test_bounded_strings_never_allow_a_control_character_and_outputs_validate(tokenizer, schema):
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), num_threads=1)
    try:
        compiled = compiler.get(StructuredOutputsParams(json=schema))
    finally:
        compiler.shutdown()
    control = control_tokens(tokenizer)
    eos = tokenizer.eos_token_id
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    rng = np.random.default_rng(0)
    finished = 0
    for _ in range(8):
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
        tokens = []
        for _ in range(150):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = allowed_tokens(bitmask, len(tokenizer))
            assert not (allowed & control).any(), tokenizer.decode(tokens)
            token = int(rng.choice(np.flatnonzero(allowed)))
            assert matcher.accept_token(token)
            if token == eos:
                break
            tokens.append(token)
        if matcher.is_terminated():
            finished += 1
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
    assert finished >= 6, finished


def test_bounded_strings_keep_their_bounds_and_refuse_control_characters():
    info = xgr.TokenizerInfo([f"<{i}>" for i in range(8)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(
        build_grammar(StructuredOutputsParams(json={"type": "string", "minLength": 2, "maxLength": 3})))
    for text, valid in [('"ab"', True), ('"a"', False), ('"abcd"', False), ('"é🙂"', True), ('"a\tb"', False),
                        ('"a\x00b"', False), ('"a\x1fb"', False), ('"a\nb"', False), ('"a"b"', False)]:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert (matcher.accept_string(text) and matcher.is_terminated()) == valid, repr(text)
        if valid:
            jsonschema.validate(json.loads(text), {"type": "string", "minLength": 2, "maxLength": 3})


def test_the_fix_keeps_xgrammars_fast_masks(tokenizer):
    """A mask inside a bounded string stays one of xgrammar's precomputed ones (an alternative in the repeated
    character, escapes say, would check most of the vocabulary at every fill: ~1,000x slower)."""
    import time

    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), num_threads=1)
    try:
        compiled = {kind: compiler.get(StructuredOutputsParams(json={"type": "string", **bounds}))
                    for kind, bounds in (("bounded", {"maxLength": 24}), ("plain", {}))}
    finally:
        compiler.shutdown()
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    seconds = {}
    for kind, grammar in compiled.items():
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string('"ab')
        matcher.fill_next_token_bitmask(bitmask)
        start = time.perf_counter()
        for _ in range(20):
            matcher.fill_next_token_bitmask(bitmask)
        seconds[kind] = time.perf_counter() - start
    assert seconds["bounded"] < 5 * seconds["plain"] + 0.01, seconds


def test_xgrammar_alone_builds_a_negative_min_length_it_cannot_compile(tokenizer):
    """Why negative length bounds are refused: xgrammar builds the grammar (the frontend's check passed), and its
    compile in the engine failed (the request aborted: a 200 with no text, finish_reason "abort")."""
    grammar = xgr.Grammar.from_json_schema('{"type": "string", "minLength": -1}')
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    with pytest.raises(RuntimeError, match="-1"):
        xgr.GrammarCompiler(info).compile_grammar(grammar)


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "minLength": -1}, "#/minLength: -1 is less than the minimum of 0"),
    ({"type": "object", "properties": {"enum": {"type": "string", "maxLength": -2}}},
     "#/properties/enum/maxLength: -2 is less than the minimum of 0"),
    ({"type": "object", "propertyNames": {"minLength": -1}}, "#/propertyNames/minLength: -1 is less"),
    ({"type": "array", "items": {"anyOf": [{"type": "string", "minLength": -1.0}]}},
     "#/items/anyOf/0/minLength: -1.0 is less than the minimum of 0"),
    ({"type": "array", "minItems": -1}, "#/minItems: -1 is less"),
])
@pytest.mark.parametrize("backend", ["xgrammar", "auto", "guidance"])
def test_negative_length_bounds_are_refused_where_they_are(schema, message, backend):
    """By JSON Schema's meta-schema (grammar.check_schema), whichever backend would take the schema."""
    with pytest.raises(ValueError, match="invalid JSON schema: " + re.escape(message)):
        validate(StructuredOutputsParams(json=schema), backend)


def test_length_bounds_in_data_or_as_names_are_no_bounds():
    schema = {"type": "object", "properties": {"minLength": {"type": "integer", "default": -1}},
              "required": ["minLength"], "examples": [{"minLength": -1}]}
    validate(StructuredOutputsParams(json=schema))
    validate(StructuredOutputsParams(json={"enum": [{"minLength": -1}, {"minItems": -5}]}))


SURROGATE = b"\xed\xa0\x80"  # U+D800 in UTF-8's three-byte form: not UTF-8 (Python decodes it as three U+FFFD)
NOT_SURROGATES = ["\ud55c", "\ud7ff", "\ue000", "\U000361dc", "é"]  # U+D55C and U+D7FF share the lead byte ED


def test_xgrammar_alone_takes_a_surrogate_into_a_string():
    """Why grammar.valid_characters leaves the surrogates out; when an xgrammar release does, this fails."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_json_schema('{"type": "string", "maxLength": 3}')
    assert xgr.GrammarMatcher(compiled).accept_string(b'"' + SURROGATE)


@pytest.mark.parametrize(("spec", "prefix"), [
    (StructuredOutputsParams(json={"type": "string"}), b'"a'),
    (StructuredOutputsParams(json={"type": "string", "maxLength": 3}), b'"'),
    (StructuredOutputsParams(json={"type": "object", "propertyNames": {"maxLength": 4}}), b'{"'),
    (StructuredOutputsParams(json_object=True), b'{"'),
    (StructuredOutputsParams(regex="a.+"), b"a"),
    (StructuredOutputsParams(regex="[^x]{1,4}"), b""),
    (StructuredOutputsParams(grammar='root ::= "<" [^>]* ">"'), b"<"),
    (StructuredOutputsParams(json={"type": "string"}, reasoning_end="</think>"), b'</think>"'),
])
def test_no_spec_takes_a_surrogate_and_every_other_character_stays(spec, prefix):
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(build_grammar(spec))
    assert not xgr.GrammarMatcher(compiled).accept_string(prefix + SURROGATE)
    for character in NOT_SURROGATES:
        assert xgr.GrammarMatcher(compiled).accept_string(prefix + character.encode()), character


@pytest.mark.parametrize(("printed", "fixed"), [
    (r"[\0-\U0010ffff]", r"[\u0000-\uD7FF\uE000-\U0010FFFF]"),  # a range across them is split
    (r"[\ud000-\ud9ff]", r"[\uD000-\uD7FF]"),
    (r"[a\-z\udc00-\ue001]", r"[\u0061\u002D\u007A\uE000-\uE001]"),  # "\-": the character, no range
    (r"[^\"\\\r\n]", r"[^\"\\\r\n\uD800-\uDFFF]"),  # a negated class names them
    (r"[^\0-\U0010ffff]", r"[^\0-\U0010ffff]"),  # already without them
    (r"[a-z]", r"[a-z]"), (r"[-a]", r"[-a]"),
    (r'"[\ud000-\udfff]"', r'"[\ud000-\udfff]"'),  # a string literal, not a class
])
def test_classes_as_xgrammar_prints_them_lose_the_surrogates(printed, fixed):
    from tokenmill.structured.grammar import _STRING_OR_CLASS, _class_without_surrogates

    assert _STRING_OR_CLASS.sub(_class_without_surrogates, printed) == fixed
