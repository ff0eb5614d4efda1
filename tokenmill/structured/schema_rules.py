"""A JSON schema checked against JSON Schema's rules (its meta-schema), by jsonschema, before a grammar is built.

xgrammar took some broken schemas: a negative minLength built a grammar whose compile then failed in the engine
(the request aborted: a 200 with no text), a format that is no string was a TypeError (a 500); others it refused
in words of its own C++ ("type mismatch! call is<type>() before get<type>()").

Draft 2020-12's meta-schema (the default of a schema without "$schema") is seven vocabularies joined by
$dynamicRef, which jsonschema resolves at every subschema: ~2.7 ms for a 600-byte schema, more than building its
grammar, on the path of every request with a new schema. Such schemas (and 2019-09's) are checked instead against
draft 7's meta-schema, one document with plain $refs (~0.6 ms), extended with the applicators and bounds 2019-09
added, so that subschemas under $defs, prefixItems, dependentSchemas or unevaluated* are checked as well. The
check is as lenient as draft 7 where the drafts differ (an array of schemas under "items" passes); a schema naming
draft 4, 6 or 7 gets its own meta-schema.

That check still took ~0.55 ms of the ~1.5 ms the frontend spends on a new schema. jsonschema-rs checks the same
meta-schema in ~2 us: a schema it passes is valid; one it refuses goes to jsonschema, whose best match names the
place (and whose verdict counts). Without jsonschema-rs installed, jsonschema checks every schema.
"""

from __future__ import annotations

import copy
import functools


@functools.cache
def _draft7_with_2019_keywords():
    import jsonschema

    meta = copy.deepcopy(jsonschema.Draft7Validator.META_SCHEMA)
    meta["$id"] = "urn:tokenmill:draft-07-with-2019-09-keywords"  # not draft 7's id: another document
    schema, schema_map = {"$ref": "#"}, {"type": "object", "additionalProperties": {"$ref": "#"}}
    count = {"$ref": "#/definitions/nonNegativeInteger"}
    meta["properties"].update({
        "$defs": schema_map, "dependentSchemas": schema_map, "prefixItems": {"$ref": "#/definitions/schemaArray"},
        "unevaluatedItems": schema, "unevaluatedProperties": schema, "minContains": count, "maxContains": count,
        "dependentRequired": {"type": "object", "additionalProperties": {"$ref": "#/definitions/stringArray"}},
        "$anchor": {"type": "string"}, "$dynamicAnchor": {"type": "string"}, "$dynamicRef": {"type": "string"},
        "deprecated": {"type": "boolean"}, "writeOnly": {"type": "boolean"},
    })
    return jsonschema.Draft7Validator(meta)


@functools.cache
def _fast_draft7_with_2019_keywords():
    """jsonschema-rs's validator of the same meta-schema, or None where it is not installed."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    # Formats unchecked, as jsonschema checks them without a format checker (draft 7's meta-schema names some).
    return jsonschema_rs.Draft7Validator(_draft7_with_2019_keywords().schema, validate_formats=False)


def _meta_validator(schema):
    import jsonschema

    declared = jsonschema.validators.validator_for(schema, default=None)
    if declared is None or declared in (jsonschema.Draft201909Validator, jsonschema.Draft202012Validator):
        return _draft7_with_2019_keywords()
    return declared(declared.META_SCHEMA)


def check_schema(schema) -> None:
    """ValueError naming where `schema` (parsed JSON) breaks JSON Schema's rules."""
    import jsonschema

    validator = _meta_validator(schema)
    if validator is _draft7_with_2019_keywords() and (fast := _fast_draft7_with_2019_keywords()) is not None:
        try:
            if fast.is_valid(schema):
                return
        except Exception:  # noqa: BLE001 - whatever it cannot take, jsonschema decides
            pass
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(schema))
    except RecursionError:  # nested past ~120 levels, which xgrammar builds (and checks) itself
        return
    if error is not None:
        where = "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in error.absolute_path)
        raise ValueError(f"#{where}: {error.message}")
