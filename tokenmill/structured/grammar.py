"""StructuredOutputsParams -> its backend and an xgrammar Grammar (or llguidance's: guidance.py), checked without the
tokenizer (the frontend's 400s)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.guidance import AUTO, GUIDANCE, XGRAMMAR, check_guidance, guidance_error, guidance_grammar
from tokenmill.structured.json_schema_check import REGEX_ITEM, unenforced_parts
from tokenmill.structured.schema_rules import check_schema
from tokenmill.structured.structural_tag import STRUCTURAL_TAG, structural_tag_grammar

logger = logging.getLogger(__name__)


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of a spec; ValueError naming what is wrong with it."""
    return _build_grammar(params)[0]


def _build_grammar(params: StructuredOutputsParams):
    """build_grammar's grammar, and whether it was parsed from its text (valid_characters rewrote it)."""
    grammar = _structure_grammar(params)
    if params.reasoning_end is not None:
        grammar = after_reasoning(grammar, params.reasoning_end, params.reasoning_start)
    fixed = valid_characters(grammar, json_strings=params.key[0] in ("json", "json_object", STRUCTURAL_TAG))
    return fixed, fixed is not grammar


def after_reasoning(grammar, end: str, start: str | None = None):
    """Free text up to and including `end` (where the model's reasoning stops), at most two newlines (what
    models write after "</think>"), then `grammar`: text before `end` is free, even if it looks like the
    structure. With `start`, the free text is a block it opens (after blanks), or there is none and `grammar`
    starts at once (reasoning_start)."""
    import xgrammar as xgr

    tag = {"type": "tag", "begin": start or "", "content": {"type": "any_text"}, "end": end}
    reasoning = xgr.Grammar.from_structural_tag(json.dumps({"type": STRUCTURAL_TAG, "format": tag}))
    newlines = xgr.Grammar.from_ebnf('root ::= "" | "\\n" | "\\n\\n"')
    if start is None:
        return xgr.Grammar.concat(reasoning, newlines, grammar)
    blanks = xgr.Grammar.from_ebnf("root ::= [ \\t\\n]*")
    return xgr.Grammar.union(xgr.Grammar.concat(blanks, reasoning, newlines, grammar), grammar)


def _structure_grammar(params: StructuredOutputsParams):
    import xgrammar as xgr

    kind, text = params.key
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            refuse_unenforced(schema, "the JSON schema")
            return json_schema_grammar(text, compact(params))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=not compact(params))
        if kind == "regex":
            return xgr.Grammar.from_regex(xgrammar_regex(text))
        if kind == "choice":
            choices = json.loads(text)
            if any("\0" in choice for choice in choices):
                raise ValueError(f"a choice holds a NUL character (\\u0000), {_NUL}")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in choices))
        if kind == STRUCTURAL_TAG:
            return structural_tag_grammar(text)
        return xgr.Grammar.from_ebnf(two_digit_hex(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except UnenforcedSchema:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid {_NAMES[kind]}: {error_text(e)}") from None


class UnenforcedSchema(ValueError):
    """A JSON schema with parts the grammar would leave out (structured/json_schema_check.py): not invalid, refused."""


def refuse_unenforced(schema, what: str) -> None:
    """UnenforcedSchema naming what of `schema` (called `what` in the message) structured outputs cannot enforce."""
    parts = unenforced_parts(schema)
    if parts is not None:
        raise UnenforcedSchema(f"{what} uses keywords that structured outputs cannot enforce (the grammar would "
                               f"leave them out, and the output could break the schema): {parts}")


def error_text(error: Exception) -> str:
    """The first line of an xgrammar error, without the C++ source location."""
    text = str(error).strip()
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__


def compact(params: StructuredOutputsParams) -> bool:
    """Whether the spec's JSON is written without free whitespace (disable_any_whitespace; None: the default)."""
    return params.disable_any_whitespace is not False


def json_schema_grammar(text: str, compact: bool = True):
    """The grammar of a JSON schema's values (RuntimeError from xgrammar for what it cannot build; `validate` has
    checked the schema against its meta-schema before, check_schema); `compact`: no free whitespace (", " and ": "
    between items), else any."""
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(text, any_whitespace=not compact)


def _check_json_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return  # said by the build
    try:
        check_schema(schema)
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: {e}") from None


# xgrammar (0.2.9 and before: mlc-ai/xgrammar#800, unreleased fixes #822/#880) writes a string with
# minLength/maxLength (and propertyNames' bounds) as a repetition of this class: it lets raw control
# characters U+0000-U+001F (but CR and LF) into the string, which JSON forbids (json.loads refuses them).
# The fix takes them out of the class. (Escapes stay out, as in xgrammar: an alternative with them in the
# repetition makes xgrammar check most of the vocabulary at run time, ~40 ms a mask instead of ~0.02 ms.)
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'

# xgrammar (0.2.9) matches a character class on UTF-8 bytes and takes the three-byte forms of the surrogates
# U+D800-U+DFFF (ED A0-BF xx), which are not UTF-8: a byte-level tokenizer can spell them, and they decode to
# three U+FFFD each, so a string the grammar counted as one character longer breaks its maxLength (one output in
# ~400 with dummy weights, which sample uniformly what the grammar allows). Every class in the grammar's text
# leaves the surrogates out: a negated class names them, a range across them is split. (Not inside a JSON
# schema's "pattern", which xgrammar keeps as a Regex(...) it expands itself.)
_STRING_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(\^?)((?:[^\]\\]|\\.)*)\]')
_CLASS_ITEM = re.compile(r'\\U[0-9a-fA-F]{8}|\\u[0-9a-fA-F]{4}|\\x[0-9a-fA-F]{2}|\\.|[^\\]', re.DOTALL)
_ESCAPES = {"0": 0, "n": 10, "r": 13, "t": 9}
_SURROGATES = (0xD800, 0xDFFF)


def valid_characters(grammar, json_strings: bool):
    """`grammar` whose character classes take only UTF-8's characters, and (`json_strings`: a grammar of JSON
    values) whose length-bounded strings only JSON's (see above)."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER) if json_strings else text
    fixed = _STRING_OR_CLASS.sub(_class_without_surrogates, fixed)
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except RuntimeError:  # xgrammar printed something it cannot parse back: better its grammar than a 400
        logger.warning("could not take invalid characters out of a grammar's classes", exc_info=True)
        return grammar


def _class_without_surrogates(match: re.Match) -> str:
    if match.group(2) is None:  # a string literal
        return match.group(0)
    negated, ranges = match.group(1) == "^", _class_ranges(match.group(2))
    low, high = _SURROGATES
    if negated:
        covered = any(first <= low and last >= high for first, last in ranges)
        return match.group(0) if covered else f"[^{match.group(2)}\\uD800-\\uDFFF]"
    if not any(first <= high and last >= low for first, last in ranges):
        return match.group(0)
    kept = []
    for first, last in ranges:
        kept += [(a, b) for a, b in ((first, min(last, low - 1)), (max(first, high + 1), last)) if a <= b]
    if not kept:
        return match.group(0)  # only surrogates: a class nothing matches either way
    return "[" + "".join(_escaped(a) if a == b else f"{_escaped(a)}-{_escaped(b)}" for a, b in kept) + "]"


def _class_ranges(body: str) -> list[tuple[int, int]]:
    """The code point ranges of a class's text as xgrammar prints it (escapes, a-b ranges)."""
    points = []
    for item in _CLASS_ITEM.findall(body):
        if item.startswith(("\\U", "\\u", "\\x")):
            points.append(int(item[2:], 16))
        elif item.startswith("\\"):
            points.append(_ESCAPES.get(item[1], ord(item[1])))
        else:
            points.append(None if item == "-" else ord(item))
    ranges, i = [], 0
    while i < len(points):
        if points[i] is None:  # a "-" that joins nothing is the character itself
            points[i] = ord("-")
        if i + 2 < len(points) and points[i + 1] is None and points[i + 2] is not None:
            ranges.append((points[i], points[i + 2]))
            i += 3
        else:
            ranges.append((points[i], points[i]))
            i += 1
    return ranges


def _escaped(point: int) -> str:
    return f"\\u{point:04X}" if point <= 0xFFFF else f"\\U{point:08X}"


MAX_REMEMBERED = 1024
"""Specs that built, remembered by digest: clients send the same schema with every request, and building its
grammar again (~1 ms for a JSON schema) would be most of the cost of adding such a request."""
_passed: OrderedDict[bytes, tuple[str, tuple[int, ...]]] = OrderedDict()
_passed_lock = threading.Lock()


def validate(params: StructuredOutputsParams, backend: str = XGRAMMAR) -> tuple[str, tuple[int, ...]]:
    """ValueError naming what is wrong with the spec (its grammar is built, once per distinct spec); else the backend
    that enforces it ("xgrammar" or "guidance": `choose_backend`, `backend` being the engine's) and the token ids its
    grammar names, which the caller checks against the vocabulary (the build does not know it)."""
    kind, text = params.key  # the JSON text of a schema: not free for a large one either
    options = (params.reasoning_end, params.reasoning_start, params.backend, backend, params.disable_any_whitespace,
               params.disable_additional_properties, params.disable_fallback)
    digest = hashlib.sha256("\0".join(map(str, (kind, text, *options))).encode("utf-8", "surrogatepass")).digest()
    with _passed_lock:
        if digest in _passed:
            _passed.move_to_end(digest)
            return _passed[digest]
    if kind == "json":
        _check_json_schema(text)
    chosen = choose_backend(params, backend)
    if chosen == GUIDANCE:
        check_guidance(params)
        token_ids = ()
    else:
        grammar, from_text = _build_grammar(params)
        token_ids = _token_ids(grammar, kind) if kind in (STRUCTURAL_TAG, "grammar") else ()
        if not from_text:  # else parsed from its text already (valid_characters), as the check would
            _check_parses_back(grammar, kind)
    with _passed_lock:
        _passed[digest] = chosen, token_ids
        if len(_passed) > MAX_REMEMBERED:
            _passed.popitem(last=False)
    return chosen, token_ids


def choose_backend(params: StructuredOutputsParams, backend: str) -> str:
    """The backend of a spec: its own, else the engine's `backend`; "auto" is xgrammar, but for a JSON schema that
    xgrammar would enforce in part only (json_schema_check.py) and llguidance whole (the fallback, unless the spec's
    disable_fallback). One neither enforces is refused (UnenforcedSchema naming its parts). Structural tags are
    xgrammar's format."""
    kind, text = params.key
    backend = params.backend or backend
    if kind == STRUCTURAL_TAG:
        return XGRAMMAR
    if backend != AUTO:
        return backend
    if kind != "json":
        return XGRAMMAR
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return XGRAMMAR  # refused by its build
    if not isinstance(schema, (dict, bool)):
        return XGRAMMAR
    try:
        refuse_unenforced(schema, "the JSON schema")
    except UnenforcedSchema as unenforced:
        if params.disable_fallback:
            raise UnenforcedSchema(f"{unenforced} (structured_outputs_config's disable_fallback keeps backend auto "
                                   "from handing it to llguidance)") from None
        try:
            error = guidance_error(guidance_grammar(params))
        except ValueError as e:  # not installed, or the schema is not for it
            error = str(e)
        if error is None:
            return GUIDANCE
        raise UnenforcedSchema(f"{unenforced}; nor can llguidance, the other backend ({error})") from None
    return XGRAMMAR


# A built grammar's text: its string literals and character classes (skipped: their text may look like anything),
# and its Token(ids) and ExcludeToken(ids), which structural tags' token formats and EBNF grammars may hold.
_TOKEN_REFS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\b(Exclude)?Token\(([^)]*)\)')


def _token_ids(grammar, kind: str) -> tuple[int, ...]:
    """The ids a grammar's Token() and ExcludeToken() name. xgrammar builds these without the vocabulary, and then
    fails to compile one with an id past it, or an ExcludeToken() of no id (an exclude_token or any_tokens format
    without exclude_tokens): in the engine, where the request could only be aborted."""
    ids: list[int] = []
    for match in _TOKEN_REFS.finditer(str(grammar)):
        if match.group(2) is None:  # a string or a character class
            continue
        found = [int(n) for n in match.group(2).replace(",", " ").split()]
        if not found:
            raise ValueError(f"invalid {_NAMES[kind]}: an exclude_token or any_tokens format needs at least one "
                             "token id in exclude_tokens (ExcludeToken() needs one)")
        ids += found
    return tuple(ids)


def _check_parses_back(grammar, kind: str) -> None:
    """ValueError for a grammar whose text xgrammar cannot parse back: it builds some specs into one (a structural
    tag's any_text that excludes "", a tag whose end is a prefix of a trigger within it), whose compile then fails the
    same way, in the engine, where the request could only be aborted (a 200 with no text, finish_reason "abort")."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_ebnf(str(grammar))
    except RuntimeError as e:
        raise ValueError(f"invalid {_NAMES[kind]}: {error_text(e)}") from None


# xgrammar's C++ messages start with "[time] /path/file.cc:line: ": not for the user.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")

_NAMES = {"json": "JSON schema", "json_object": "JSON object spec", "regex": "regex", "choice": "choice",
          "grammar": "grammar", STRUCTURAL_TAG: "structural tag"}


_NUL_ESCAPES = ("\\x00", "\\u0000", "\\0")
_NUL = "which xgrammar cannot match (it would leave it out of the output)"
_NUL_ALONE = f"{_NUL}, but in a class with other characters"


def xgrammar_regex(regex: str) -> str:
    """`regex` as xgrammar's reader takes it (`two_digit_hex`); ValueError for a NUL alone (outside a class, or a
    class of it only), which xgrammar drops (a\\x00b would match "ab")."""
    in_class = None  # the items of the class being read
    for item in REGEX_ITEM.findall(regex):
        if in_class is None and item in _NUL_ESCAPES:
            raise ValueError(f"{item} is a NUL character, {_NUL_ALONE}")
        if in_class is None and item == "[":
            in_class = []
        elif in_class is not None and item == "]":
            if len(in_class) == 1 and in_class[0] in _NUL_ESCAPES:
                raise ValueError(f"[{in_class[0]}] is a NUL character, {_NUL_ALONE}")
            in_class = None
        elif in_class is not None:
            in_class.append(item)
    return two_digit_hex(regex)


def two_digit_hex(text: str) -> str:
    """A regex or an EBNF grammar with each \\xHH escape written \\u00HH: \\xHH is two hex digits, as in every regex
    dialect and GBNF, where xgrammar reads every hex digit after \\x (\\x2Ecom would be U+02EC then "om", not
    ".com")."""
    return "".join("\\u00" + item[2:] if item.startswith("\\x") and len(item) == 4 else item
                   for item in REGEX_ITEM.findall(text))


def _ebnf_string(text: str) -> str:
    """An EBNF string literal matching `text` exactly (JSON's escaping is EBNF's)."""
    return json.dumps(text, ensure_ascii=False)  # not \uD83D\uDE00: xgrammar reads each as a lone surrogate
