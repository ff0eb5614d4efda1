"""The parts of a JSON schema that xgrammar's grammar would not enforce, so that such a schema is refused.

xgrammar (0.2.9, checked keyword by keyword against jsonschema) builds a grammar for any schema, silently leaving
out what it does not implement: the output may then break the schema the client asked for. vLLM falls back to
another backend for some of these; with xgrammar alone the request is refused instead, naming each part. What it
leaves out:
- keywords it has no rule for: not, if/then/else, dependentSchemas, dependentRequired, dependencies, contains,
  minContains, maxContains, uniqueItems, $dynamicRef, $recursiveRef; a multipleOf but a whole number up to 1024 on
  integers without a minimum or maximum; minLength/maxLength beside a pattern or a format;
- the formats of JSON Schema it does not write (idn-email, idn-hostname, iri, iri-reference, regex; formats JSON
  Schema does not define are annotations, which validators ignore too);
- a keyword of one type's (minimum, maxLength, required, ...) where the type is neither given nor inferred from
  properties, additionalProperties, items or prefixItems (as xgrammar infers it);
- whatever stands beside anyOf, oneOf, allOf, $ref, enum or const (each of them replaces the whole schema; a type
  beside enum or const is kept only if every value has it), and an allOf of more than one schema;
- a required property that properties does not define, and a propertyNames beyond a string's plain keywords
  (pattern, minLength, maxLength, format, enum, const: a name is a string, its type is not needed);
- the JSON escaping of a pattern that names ", \\ or a control character (written into the string unescaped).
oneOf is written as anyOf: alternatives that overlap may both match (no backend we know of enforces that either).
Annotations (title, description, default, examples, $schema, $id, $comment, ...) and keywords JSON Schema does not
define pass, as they constrain nothing.
"""

from __future__ import annotations

import re
from typing import Any

_NEVER = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains",
          "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
_UNWRITTEN_FORMATS = {"idn-email", "idn-hostname", "iri", "iri-reference", "regex"}
_FORMATS = _UNWRITTEN_FORMATS | {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                                 "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer"}
"""JSON Schema's formats: others are annotations (validators ignore them)."""
_TYPE_KEYWORDS = {
    "number": ("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"),
    "object": ("properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required",
               "minProperties", "maxProperties", "propertyNames"),
}
_CONSTRAINING = {k for keys in _TYPE_KEYWORDS.values() for k in keys} | {
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "uniqueItems", *_NEVER}
_WHOLE = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")
"""Keywords that xgrammar lets replace the whole schema (the first found, in its order)."""
_NAME_KEYWORDS = {"type", "pattern", "minLength", "maxLength", "format", "enum", "const"}
_PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "null": (type(None),),
                 "object": (dict,), "array": (list,)}
MAX_LISTED = 6


def unenforced_parts(schema: Any) -> str | None:
    """What of `schema` xgrammar would not enforce ("not at #/properties/a; ..."), or None if nothing."""
    found: list[str] = []
    _visit(schema, "#", found)
    if not found:
        return None
    more = f"; and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
    return "; ".join(found[:MAX_LISTED]) + more


def _visit(node: Any, path: str, found: list[str]) -> None:
    if not isinstance(node, dict):
        return
    keys = [key for key in node if key in _CONSTRAINING]
    found += [f"{key} at {path}" for key in keys if key in _NEVER]
    if node.get("uniqueItems") is True:
        found.append(f"uniqueItems at {path}")
    if _format(node) in _UNWRITTEN_FORMATS:
        found.append(f"format {node['format']!r} at {path}")
    whole = next((key for key in _WHOLE if key in node), None)
    if whole is not None:
        beside = [k for k in keys if k != whole and k not in _NEVER and k != "uniqueItems"
                  and not (k == "type" and whole in ("enum", "const"))]
        if beside:
            found.append(f"{', '.join(beside)} beside {whole} at {path} (only the {whole} is kept)")
        if whole in ("enum", "const") and "type" in node:
            values = node["enum"] if whole == "enum" and isinstance(node["enum"], list) else [node.get(whole)]
            if not all(_has_type(value, node["type"]) for value in values):
                found.append(f"{whole} values that type {node['type']!r} excludes at {path}")
        if whole == "allOf" and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
            found.append(f"allOf of more than one schema at {path} (merge them into one)")
    else:
        _check_typed_keywords(node, keys, path, found)
        _check_string(node, path, found)
    _visit_children(node, path, found)


def _check_typed_keywords(node: dict, keys: list[str], path: str, found: list[str]) -> None:
    types = node.get("type")
    if types is None:
        inferred = ({"object"} if "properties" in node or "additionalProperties" in node else
                    {"array"} if "items" in node or "prefixItems" in node else set())
        loose = [k for family, words in _TYPE_KEYWORDS.items() if family not in inferred for k in words
                 if k in keys and (k != "format" or _format(node) in _FORMATS)]
        if loose:
            found.append(f"{', '.join(loose)} without a type at {path} (give \"type\")")
            return
        types = inferred
    types = {types} if isinstance(types, str) else {t for t in types if isinstance(t, str)} if isinstance(
        types, list) else set()
    if "multipleOf" in node and ("number" in types or "integer" not in types):
        found.append(f"multipleOf on numbers that need not be integers at {path} (use \"type\": \"integer\")")
    elif "multipleOf" in node and any(k in node for k in _TYPE_KEYWORDS["number"][1:]):
        found.append(f"multipleOf with a minimum or maximum at {path}")
    elif "multipleOf" in node and not _integer_step_kept(node["multipleOf"]):
        found.append(f"multipleOf {node['multipleOf']!r} on integers at {path} (xgrammar keeps whole numbers from 1 to "
                     f"{MAX_INTEGER_STEP} only)")
    if "object" in types and isinstance(node.get("required"), list):
        defined = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in node["required"] if isinstance(name, str) and name not in defined]
        if missing:
            found.append(f"required {', '.join(map(repr, missing))} that properties does not define at {path}")
    names = node.get("propertyNames")
    if isinstance(names, dict):
        beyond = [k for k in names if k in _CONSTRAINING and k not in _NAME_KEYWORDS]
        if beyond:
            found.append(f"{', '.join(beyond)} in propertyNames at {path}")
        _check_string(names, f"{path}/propertyNames", found)


def _check_string(node: dict, path: str, found: list[str]) -> None:
    shape = "pattern" if "pattern" in node else "format" if _format(node) in _FORMATS else None
    if shape is not None and ("minLength" in node or "maxLength" in node):
        found.append(f"minLength/maxLength with a {shape} at {path} (put the length into the pattern)")
    if isinstance(node.get("pattern"), str) and _names_json_escaped(node["pattern"]):
        found.append(f"a pattern of a character JSON escapes at {path} (\", \\ or a control character: the grammar "
                     "would write it unescaped)")


REGEX_ITEM = re.compile(r"\\x[0-9A-Fa-f]{2}|\\u[0-9A-Fa-f]{4}|\\.|.", re.DOTALL)
"""A regex's escapes (\\xHH and \\uHHHH whole) and characters, one by one."""
_CONTROL_ESCAPES = {"\\n", "\\r", "\\t", "\\f", "\\v", "\\0"}


def _names_json_escaped(pattern: str) -> bool:
    """Whether a pattern names a character that a JSON string escapes (", \\, U+0000-U+001F), as itself or an escape.
    xgrammar writes a pattern that does into the string's grammar character for character, unescaped (a pattern
    ^[0-9]+"$ let '"27""' through, ^a\\\\b$ '"a\\b"'); others it keeps as a regex it matches on the JSON text."""
    for item in REGEX_ITEM.findall(pattern):
        if item in _CONTROL_ESCAPES or item in ('\\"', "\\\\"):
            return True
        point = int(item[2:], 16) if len(item) > 2 else ord(item) if len(item) == 1 else None
        if point is not None and (point < 0x20 or point in (0x22, 0x5C)):
            return True
    return False


def _visit_children(node: dict, path: str, found: list[str]) -> None:
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            for name, child in node[key].items():
                _visit(child, f"{path}/{key}/{_escape(name)}", found)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            for i, child in enumerate(node[key]):
                _visit(child, f"{path}/{key}/{i}", found)
    for key in ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties"):
        _visit(node.get(key), f"{path}/{key}", found)


MAX_INTEGER_STEP = 1024
"""The largest integer multipleOf xgrammar writes into its grammar: it ignores larger ones and fractions (with a
warning on stderr), so 7 passed {"type": "integer", "multipleOf": 2048}."""


def _integer_step_kept(step: Any) -> bool:
    """Whether xgrammar enforces an integer multipleOf of `step`, or leaves out one that constrains nothing (a
    fraction 1/k: every integer is a multiple of it). Not a number (or not above 0): xgrammar refuses it."""
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step <= 0:
        return True
    if isinstance(step, int):
        return step <= MAX_INTEGER_STEP
    return (1 / step).is_integer()


def _format(node: dict) -> str | None:
    """The node's format, None if it has none or not a string: a malformed value (a list, an object) is xgrammar's
    to refuse, and was a TypeError here (a 500) where it was looked up among the formats."""
    value = node.get("format")
    return value if isinstance(value, str) else None


def _has_type(value: Any, types: Any) -> bool:
    names = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)] if isinstance(
        types, list) else []
    if isinstance(value, bool):  # an int to Python, not a number to JSON
        return "boolean" in names
    return any(isinstance(value, _PYTHON_TYPES.get(name, ())) for name in names) or (
        "integer" in names and isinstance(value, float) and value.is_integer())


def _escape(name: str) -> str:
    """A name as a JSON pointer's segment."""
    return name.replace("~", "~0").replace("/", "~1")
