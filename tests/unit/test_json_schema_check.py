"""JSON schemas with parts xgrammar 0.2.9 leaves out of its grammar are refused (structured/json_schema_check.py).

Each refused schema comes with an instance that xgrammar's grammar of it accepts and jsonschema rejects: the
refusal is needed (were xgrammar to enforce the part, the test would fail and the check could go). Annotations
and what xgrammar does enforce pass."""

import dataclasses
import json

import jsonschema
import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.grammar import json_schema_grammar, validate

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

INT = {"type": "integer"}
REFUSED = [  # (schema, what the message names, an instance the bare grammar lets through that breaks the schema)
    ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"]},
     "not at #/properties/n", {"n": 3}),
    ({"type": "array", "items": INT, "uniqueItems": True}, "uniqueItems at #", [1, 1]),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "if at #", 7),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}, "dependentRequired",
     {"a": 1}),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
     "dependentSchemas", {"a": 1}),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf on numbers", 0.3),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf with a minimum", 4),
    ({"type": "integer", "multipleOf": 2048}, "multipleOf 2048 on integers", 7),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf 1.5 on integers", 1),
    ({"type": "string", "format": "regex"}, "format 'regex'", "("),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength/maxLength with a pattern", "a"),
    ({"type": "string", "pattern": r"^a\\b$"}, "pattern of a character JSON escapes", "a\b"),  # \\ raw: \b
    ({"maximum": 3}, "maximum without a type", 5),
    ({"type": "object", "required": ["a"], "additionalProperties": True}, "required 'a' that properties", {}),
    ({"allOf": [INT, {"type": "integer", "minimum": 3}]}, "allOf of more than one", 1),
    ({"type": "integer", "minimum": 5, "anyOf": [INT]}, "type, minimum beside anyOf", 1),
    ({"$defs": {"p": {"type": "object", "properties": {"a": INT}}}, "$ref": "#/$defs/p", "required": ["a"]},
     "required beside $ref", {}),
    ({"type": "string", "enum": ["a", 1]}, "enum values that type 'string' excludes", 1),
    ({"type": "object", "propertyNames": {"anyOf": [{"pattern": "^a"}]}, "additionalProperties": INT},
     "anyOf in propertyNames", {"c": 1}),
]


@pytest.mark.parametrize(("schema", "named", "breaking"), REFUSED, ids=[r[1].split(" at")[0] for r in REFUSED])
def test_what_the_grammar_leaves_out_is_refused(schema, named, breaking):
    assert _is_grammar_accept_string(json_schema_grammar(json.dumps(schema)), json.dumps(breaking))
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert not jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(breaking)
    with pytest.raises(ValueError, match="cannot enforce") as info:
        validate(StructuredOutputsParams(json=schema))
    assert named in str(info.value)


def test_a_structural_tags_schemas_are_checked_too():
    tag = {"structures": [{"begin": "<a>", "schema": {"type": "array", "uniqueItems": True}, "end": "</a>"}],
           "triggers": ["<a>"]}
    with pytest.raises(ValueError, match=r"structures\[0\]\.schema uses keywords .* uniqueItems at #"):
        validate(StructuredOutputsParams(structural_tag=tag))


@pytest.mark.parametrize("schema", [
    {"type": "string", "format": {}}, {"type": "object", "propertyNames": {"format": ["email"]}},
    {"format": {"a": 1}, "minimum": 1}, {"type": [{}], "minimum": 1}, {"enum": [1], "type": [["integer"]]},
    {"type": "object", "properties": {}, "required": [{}]},
], ids=["format", "property-names-format", "format-without-type", "type", "type-beside-enum", "required"])
def test_malformed_keyword_values_are_a_400_not_a_crash(schema):
    """Before: a TypeError looking a dict or list up among the formats, types or properties, a 500 for the request."""
    with pytest.raises(ValueError):
        validate(StructuredOutputsParams(json=schema))


def test_annotations_and_enforced_keywords_pass():
    annotated = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:person", "$comment": "c",
                 "title": "Person", "description": "d", "examples": [{"name": "A"}], "default": {"name": "A"},
                 "deprecated": False, "readOnly": True, "x-vendor": 1, "discriminator": {"propertyName": "kind"},
                 "type": "object", "properties": {
                     "name": {"type": "string", "maxLength": 5, "title": "n"},
                     "mail": {"type": "string", "format": "email"},
                     "code": {"type": "string", "format": "password", "maxLength": 4},  # not JSON Schema's
                     "pets": {"type": "array", "items": {"$ref": "#/$defs/pet", "description": "p"}, "maxItems": 2},
                     "kind": {"type": "string", "enum": ["a", "b"]},
                     "n": {"anyOf": [{"type": "integer", "multipleOf": 2}, {"type": "null"}], "default": None},
                     "tags": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                              "additionalProperties": {"type": "string"}}},
                 "required": ["name"], "additionalProperties": False,
                 "$defs": {"pet": {"oneOf": [{"const": "cat"}, {"const": "dog"}]}}}
    validate(StructuredOutputsParams(json=annotated))
    validate(StructuredOutputsParams(json={"type": "array", "uniqueItems": False, "items": {**INT, "minimum": 1}}))


# structured_outputs_config's options, as the engine resolves them onto each spec (StructuredOutputsParams).
NESTED = {"type": "object", "properties": {"a": INT, "o": {"type": "object", "properties": {"b": {"type": "string"}}},
                                           "l": {"type": "array", "items": INT}}, "required": ["a"]}
VALUE = {"a": 1, "o": {"b": "x y"}, "l": [1, 2]}


def takes(params: StructuredOutputsParams, text: str) -> bool:
    """Whether the spec's grammar under its backend (xgrammar's, or llguidance's over a byte tokenizer) takes `text`."""
    from tokenmill.structured.grammar import build_grammar
    from tokenmill.structured.guidance import guidance_grammar

    if params.backend != "guidance":
        return _is_grammar_accept_string(build_grammar(params), text)
    llguidance = pytest.importorskip("llguidance")
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), guidance_grammar(params), log_level=0)
    ids = list(text.encode())
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_disable_any_whitespace_writes_json_without_free_whitespace(backend):
    # The one compact form of each backend (xgrammar's ", " and ": ", llguidance's "," and ":"), nothing else.
    separators = (", ", ": ") if backend == "xgrammar" else (",", ":")
    for kind in ({"json": NESTED}, {"json_object": True}):
        compact = StructuredOutputsParams(**kind, backend=backend)  # unset: the default, compact
        for params in (compact, StructuredOutputsParams(**kind, backend=backend, disable_any_whitespace=True)):
            assert takes(params, json.dumps(VALUE, separators=separators))
            other = (",", ":") if separators == (", ", ": ") else (", ", ": ")
            for spaced in (json.dumps(VALUE, separators=other), json.dumps(VALUE, indent=2), " " + json.dumps(VALUE)):
                assert not takes(params, spaced), spaced
        # False: any whitespace between JSON's tokens (vLLM's default), strings as they are.
        free = StructuredOutputsParams(**kind, backend=backend, disable_any_whitespace=False)
        for text in (json.dumps(VALUE, indent=2), json.dumps(VALUE, separators=(",", ":")),
                     '{ "a" :1 ,\n\t"o": {"b":"x y"}, "l" : [ 1,2 ] }'):
            assert takes(free, text) and json.loads(text) == VALUE, text


def test_disable_additional_properties_keeps_llguidance_to_the_named_properties():
    extra = [{**VALUE, "z": 2}, {**VALUE, "o": {"b": "x", "z": 2}}]  # at the top, in a nested object
    # Without it llguidance lets the model add properties that xgrammar refuses: the inconsistency it removes.
    loose = StructuredOutputsParams(json=NESTED, backend="guidance")
    strict = dataclasses.replace(loose, disable_additional_properties=True)
    for value in extra:
        assert jsonschema.Draft202012Validator(NESTED).is_valid(value)  # the schema itself allows them
        text = json.dumps(value, separators=(",", ":"))
        assert takes(loose, text) and not takes(strict, text), text
        assert not takes(StructuredOutputsParams(json=NESTED), json.dumps(value))  # xgrammar's, always
    assert takes(strict, json.dumps(VALUE, separators=(",", ":")))


def test_no_additional_properties_changes_only_a_copy_and_only_schemas():
    from tokenmill.structured.guidance import guidance_grammar, no_additional_properties

    schema = {"type": "object", "properties": {
        "kept": {"type": "object", "additionalProperties": INT},  # said: kept
        "loose": {"type": "object", "unevaluatedProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {"a": INT}}, {"type": ["object", "null"]}]},
        "both": {"allOf": [{"properties": {"a": INT}}, {"properties": {"b": INT}}]},  # each would forbid the other's
        "data": {"type": "object", "enum": [{"type": "object"}], "default": {"type": "object"}}},
        "$defs": {"d": {"properties": {"c": INT}}}}
    original = json.loads(json.dumps(schema))
    guidance_grammar(StructuredOutputsParams(json=schema, backend="guidance", disable_additional_properties=True))
    assert schema == original  # the caller's dict as it was
    done = no_additional_properties(json.loads(json.dumps(schema)))
    props = done["properties"]
    assert done["additionalProperties"] is False and done["$defs"]["d"]["additionalProperties"] is False
    assert props["kept"]["additionalProperties"] == INT and "additionalProperties" not in props["loose"]
    assert [branch["additionalProperties"] for branch in props["either"]["anyOf"]] == [False, False]
    assert all("additionalProperties" not in branch for branch in props["both"]["allOf"])
    assert props["data"]["enum"] == [{"type": "object"}] and props["data"]["default"] == {"type": "object"}


def test_disable_fallback_keeps_auto_on_xgrammar():
    only_llguidance = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$",
                                                                 "maxLength": 5}}, "required": ["code"]}
    assert validate(StructuredOutputsParams(json=only_llguidance), "auto")[0] == "guidance"  # the fallback
    with pytest.raises(ValueError, match=r"minLength/maxLength with a pattern at #/properties/code .*"
                                         r"disable_fallback keeps backend auto from handing it to llguidance"):
        validate(StructuredOutputsParams(json=only_llguidance, disable_fallback=True), "auto")
    # A backend named is no fallback: the option changes nothing there.
    assert validate(StructuredOutputsParams(json=only_llguidance, disable_fallback=True), "guidance")[0] == "guidance"
    assert validate(StructuredOutputsParams(json=NESTED, disable_fallback=True), "auto")[0] == "xgrammar"


@pytest.mark.parametrize("step", [2048, 1.5])
def test_an_integer_step_xgrammar_drops_goes_to_llguidance_which_keeps_it(step):
    """xgrammar writes no integer multipleOf above 1024 nor a fraction that is not 1/k (7 passed multipleOf 2048):
    backend auto hands the schema to llguidance, whose grammar holds the step."""
    schema = {"type": "integer", "multipleOf": step}
    backend, _ = validate(StructuredOutputsParams(json=schema), "auto")
    assert backend == "guidance"
    params = StructuredOutputsParams(json=schema, backend="guidance")
    assert [takes(params, text) for text in ("7", "6", "4096")] == [False, step == 1.5, step == 2048]


def test_a_schema_nested_past_the_meta_schema_checks_recursion_is_still_served():
    """jsonschema's meta-schema check recurses a few frames per level and gives up past ~120 levels; such a schema is
    left to xgrammar's own checks, as before the meta-schema check (a RecursionError there was a 500)."""
    schema = {"type": "integer"}
    for _ in range(400):
        schema = {"type": "array", "items": schema}
    assert validate(StructuredOutputsParams(json=schema))[0] == "xgrammar"
