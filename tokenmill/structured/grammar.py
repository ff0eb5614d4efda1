"""StructuredOutputsParams -> an xgrammar Grammar, checked without the tokenizer (the frontend's 400s)."""

from __future__ import annotations

import json
import re

from tokenmill.sampling_params import StructuredOutputsParams


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of a spec; ValueError naming what is wrong with it."""
    import xgrammar as xgr

    kind, text = params.key
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in json.loads(text)))
        return xgr.Grammar.from_ebnf(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except (RuntimeError, ValueError, TypeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"invalid {_NAMES[kind]}: {_SOURCE_PREFIX.sub('', first_line)}") from None


def validate(params: StructuredOutputsParams) -> None:
    build_grammar(params)


# xgrammar's C++ messages start with "[time] /path/file.cc:line: ": not for the user.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")

_NAMES = {"json": "JSON schema", "json_object": "JSON object spec", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def _ebnf_string(text: str) -> str:
    """An EBNF string literal matching `text` exactly (JSON's escaping is EBNF's)."""
    return json.dumps(text)
