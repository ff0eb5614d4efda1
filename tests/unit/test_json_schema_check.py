"""JSON schemas with parts xgrammar 0.2.9 leaves out of its grammar are refused (structured/json_schema_check.py).

Each refused schema comes with an instance that xgrammar's grammar of it accepts and jsonschema rejects: the
refusal is needed (were xgrammar to enforce the part, the test would fail and the check could go). Annotations
and what xgrammar does enforce pass."""

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
    ({"type": "string", "format": "regex"}, "format 'regex'", "("),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength/maxLength with a pattern", "a"),
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
