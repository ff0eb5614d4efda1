"""structured/schema_rules.py: schemas without "$schema" are checked against draft 7's meta-schema extended with
2019-09's keywords (fast) rather than 2020-12's (slow): the same verdicts as 2020-12's meta-schema on schemas
where the drafts agree, and the keywords 2019-09 added are checked inside."""

import jsonschema
import pytest

from tokenmill.structured.schema_rules import check_schema

VALID = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
    {"$defs": {"n": {"type": "number", "exclusiveMinimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
    {"type": "array", "prefixItems": [{"type": "string"}, {"enum": [1, 2]}], "items": False, "minContains": 1,
     "contains": {"const": 1}},
    {"type": "object", "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"b": {"required": ["c"]}},
     "unevaluatedProperties": False, "if": {"required": ["a"]}, "then": {"maxProperties": 3}},
    {"anyOf": [{"type": "string", "format": "date", "pattern": "^x"}, {"type": ["null", "boolean"]}],
     "$anchor": "top", "deprecated": True, "writeOnly": False, "$comment": "c"},
    True,
]
INVALID = [
    ({"type": "string", "minLength": -1}, "#/minLength: -1 is less than the minimum of 0"),
    ({"type": "strin"}, "#/type: "),
    ({"properties": {"n": {"minimum": "0"}}}, "#/properties/n/minimum: '0' is not of type 'number'"),
    ({"$defs": {"s": {"type": "string", "maxLength": -2}}}, "#/$defs/s/maxLength: -2 is less than the minimum of 0"),
    ({"prefixItems": [{"type": "array", "minItems": -1}]}, "#/prefixItems/0/minItems: -1 is less"),
    ({"dependentSchemas": {"a": {"minProperties": -1}}}, "#/dependentSchemas/a/minProperties: -1 is less"),
    ({"unevaluatedProperties": {"maxLength": "5"}}, "#/unevaluatedProperties/maxLength: '5' is not of type"),
    ({"type": "array", "minContains": -1}, "#/minContains: -1 is less"),
    # Nested: the meta-schema's "#" is the extended one at every level.
    ({"items": {"prefixItems": [{"$defs": {"s": {"minLength": -1}}}]}}, "#/items/prefixItems/0/$defs/s/minLength"),
    ({"dependentRequired": {"a": [1]}}, "#/dependentRequired/a/0: 1 is not of type 'string'"),
    ({"required": "a"}, "#/required: 'a' is not of type 'array'"),
    ({"enum": 3}, "#/enum: 3 is not of type 'array'"),
    ({"multipleOf": 0}, "#/multipleOf: 0 is less than or equal to the minimum of 0"),
]


@pytest.mark.parametrize("schema", VALID)
def test_valid_schemas_pass_as_under_2020_12s_meta_schema(schema):
    assert jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA).is_valid(schema)
    check_schema(schema)


@pytest.mark.parametrize(("schema", "message"), INVALID)
def test_broken_schemas_are_refused_as_under_2020_12s_meta_schema(schema, message):
    assert not jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA).is_valid(schema)
    with pytest.raises(ValueError) as error:
        check_schema(schema)
    assert str(error.value).startswith(message)


def test_a_declared_draft_is_checked_by_its_own_meta_schema():
    # Draft 4's exclusiveMinimum is a boolean; 2019-09's and 7's a number.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 0, "exclusiveMinimum": True}
    check_schema(draft4)
    with pytest.raises(ValueError, match="True is not of type 'number'"):
        check_schema({**draft4, "$schema": "https://json-schema.org/draft/2020-12/schema"})
    with pytest.raises(ValueError, match="True is not of type 'number'"):
        check_schema({key: value for key, value in draft4.items() if key != "$schema"})


KEYWORDS = ["type", "minLength", "maxLength", "minimum", "exclusiveMaximum", "multipleOf", "minItems", "required",
            "enum", "const", "pattern", "format", "properties", "items", "prefixItems", "$defs", "anyOf", "not",
            "additionalProperties", "dependentRequired", "minContains", "unevaluatedProperties", "$ref", "$anchor"]


def schemas():
    """Schema-like JSON: meta-schema keywords with values of every kind, right and wrong, nested."""
    from hypothesis import strategies as st

    leaf = st.one_of(st.integers(-3, 3), st.floats(-2, 2, allow_nan=False), st.booleans(), st.none(),
                     st.sampled_from(["string", "integer", "strin", "#", "#/$defs/a", "^a+$", "date", "a"]))

    def extend(inner):
        return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYWORDS + ["a", "b"]), inner,
                                                                      max_size=4))

    return st.dictionaries(st.sampled_from(KEYWORDS), st.recursive(leaf, extend, max_leaves=12), max_size=5)


def test_jsonschema_rs_passes_only_what_jsonschema_passes():
    """The fast check's verdicts against jsonschema's on random schema-like JSON: a schema jsonschema-rs passes
    must pass jsonschema too (one it refuses goes to jsonschema, whose verdict counts)."""
    pytest.importorskip("jsonschema_rs")
    from hypothesis import given, settings

    from tokenmill.structured.schema_rules import _draft7_with_2019_keywords, _fast_draft7_with_2019_keywords

    slow, fast = _draft7_with_2019_keywords(), _fast_draft7_with_2019_keywords()
    verdicts = {True: 0, False: 0}

    @settings(max_examples=600, deadline=None)
    @given(schemas())
    def check(schema):
        passed = fast.is_valid(schema)
        verdicts[passed] += 1
        if passed:
            assert slow.is_valid(schema), schema

    check()
    assert verdicts[True] > 5 and verdicts[False] > 5, verdicts  # both kinds drawn
