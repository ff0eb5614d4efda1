"""Structural tags (vLLM's structured_outputs.structural_tag) -> an xgrammar Grammar, checked.

Two forms are accepted, as by vLLM:
- the legacy one, {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}: free text until a
  trigger is written, then one of the structures whose begin starts with it (its content JSON under its
  schema, then its end), then free text again;
- xgrammar's format object, {"type": "structural_tag", "format": {...}}: any of its formats (tag,
  triggered_tags, sequence, or, json_schema, regex, grammar, any_text, ...), nested.

JSON in a tag is written compactly (whatever structured_outputs_config's disable_any_whitespace says): every
plain json_schema format (the "json" style, no other option) becomes the grammar that grammar.py makes of its
schema. Token formats must
give token ids: a token given by its text needs the tokenizer, which the frontend's check does not have.
"""

from __future__ import annotations

import json
from typing import Any

STRUCTURAL_TAG = "structural_tag"
_PLAIN_JSON_KEYS = {"type", "json_schema", "style"}


def structural_tag_grammar(text: str):
    """The xgrammar Grammar of a structural tag given as JSON text; ValueError saying what is wrong (its
    caller says it is about the structural tag)."""
    import xgrammar as xgr

    from tokenmill.structured.grammar import error_text  # grammar.py imports this module

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("it must be a JSON object")
    if "structures" in spec or "triggers" in spec:
        spec = _from_legacy(spec)
    elif "format" not in spec:
        raise ValueError("it needs either format (xgrammar's format object) or structures and triggers (the "
                         "legacy form)")
    elif spec.get("type", STRUCTURAL_TAG) != STRUCTURAL_TAG:
        raise ValueError(f"its type must be \"structural_tag\", got {spec['type']!r}")
    spec = {"type": STRUCTURAL_TAG, "format": _compact_json(spec["format"], "format")}
    try:
        return xgr.Grammar.from_structural_tag(json.dumps(spec))
    except RuntimeError as e:
        message = error_text(e)
        if "requires tokenizer_info" in message:
            message = "a token must be given by its id here, not by its text"
        raise ValueError(message.removeprefix("Invalid structural tag error: ")) from None


def _from_legacy(spec: dict[str, Any]) -> dict[str, Any]:
    """The legacy form as xgrammar's triggered_tags format, each structure's shape checked."""
    extra = sorted(set(spec) - {"type", "structures", "triggers"})
    if extra:
        raise ValueError(f"with structures and triggers it takes no {', '.join(extra)}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list")
    tags = []
    for i, structure in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(structure, dict):
            raise ValueError(f"{where} must be an object with begin, schema and end")
        begin, schema, end = structure.get("begin"), structure.get("schema"), structure.get("end")
        if not isinstance(begin, str) or not begin or not isinstance(end, str):
            raise ValueError(f"{where} needs begin (a non-empty string) and end (a string)")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.schema is not valid JSON: {e}") from None
        if not any(begin.startswith(trigger) for trigger in triggers):
            raise ValueError(f"{where}.begin {begin!r} does not start with any of the triggers")
        content = {"type": "grammar", "grammar": _json_grammar_text(schema, f"{where}.schema")}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": end})
    return {"type": STRUCTURAL_TAG, "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def _compact_json(node: Any, path: str) -> Any:
    """`node` (a format, or a part of one) with its plain json_schema formats as compact-JSON grammars, and the \\xHH
    escapes of its regex and grammar formats as xgrammar reads them (grammar.py's two_digit_hex)."""
    if isinstance(node, list):
        return [_compact_json(item, f"{path}[{i}]") for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema":
        if set(node) <= _PLAIN_JSON_KEYS and node.get("style", "json") == "json" and "json_schema" in node:
            return {"type": "grammar", "grammar": _json_grammar_text(node["json_schema"], f"{path}.json_schema")}
        from tokenmill.structured.grammar import refuse_unenforced

        refuse_unenforced(node.get("json_schema"), f"the structural tag's {path}.json_schema")
        return node  # another style or options of xgrammar's own (its whitespace rules then apply)
    from tokenmill.structured.grammar import two_digit_hex, xgrammar_regex

    if node.get("type") == "regex" and isinstance(node.get("pattern"), str):
        return {**node, "pattern": xgrammar_regex(node["pattern"])}
    if node.get("type") == "grammar" and isinstance(node.get("grammar"), str):
        return {**node, "grammar": two_digit_hex(node["grammar"])}
    return {key: _compact_json(value, f"{path}.{key}") for key, value in node.items()}


def _json_grammar_text(schema: Any, path: str) -> str:
    """The compact-JSON grammar of the schema at `path`, as EBNF text."""
    from tokenmill.structured.grammar import error_text, json_schema_grammar, refuse_unenforced
    from tokenmill.structured.schema_rules import check_schema

    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{path} must be a JSON schema (an object)")
    try:
        check_schema(schema)
    except ValueError as e:
        raise ValueError(f"{path} is not a valid JSON schema: {e}") from None
    refuse_unenforced(schema, f"the structural tag's {path}")
    try:
        return str(json_schema_grammar(json.dumps(schema)))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid JSON schema: {error_text(e)}") from None
