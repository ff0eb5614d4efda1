"""Llama 3.2 and Llama 4: a Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

as the whole output, or after <|python_start|> (Llama 4, closed by <|python_end|>) or <|python_tag|>. It is
read with `ast`, literals only (strings, numbers, True/False/None, also true/false/null, lists, dicts): nothing
is evaluated.
"""

from __future__ import annotations

import ast
import json
import re

from tokenmill.server.tool_parsers.base import BracketScanner, Call, ToolParser, skip_blank

# What may follow "[" while the list is not yet known to be calls: blanks, a (dotted) name, then "(".
HEAD = re.compile(r"\s*(?:[A-Za-z_][\w.]*\s*(\()?)?")
NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def literal(node: ast.AST):
    """The JSON value a literal's syntax tree stands for; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        keys = [literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a key that is not a string")
        return dict(zip(keys, (literal(v) for v in node.values), strict=True))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before something that is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in NAMES:
        return NAMES[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return head and head + "." + node.attr
    return None


def python_calls(source: str) -> list[Call] | None:
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not (name := dotted(node.func)):
                return None
            if any(k.arg is None for k in node.keywords):
                return None  # **kwargs
            arguments = {k.arg: literal(k.value) for k in node.keywords}
            calls.append((name, json.dumps(arguments, ensure_ascii=False, allow_nan=False), None))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    # No structural tag (strict_trigger None): the arguments are Python literals, which no JSON schema style writes.
    markers = ("<|python_start|>", "<|python_tag|>")
    start_chars = "["
    end = "<|python_end|>"

    def _begin(self) -> None:
        self._list = -1  # where "[" is, once found
        self._headed = False  # "[name(" seen: from there on, only the closing "]" is awaited
        self._scanner = BracketScanner(0, python=True)

    def _scan(self, text, final):
        if self._list < 0:
            i = skip_blank(text, self._body)
            if i == len(text):
                return None
            if text[i] != "[":
                return i, None
            self._list, self._scanner = i, BracketScanner(i, python=True)
        if not self._headed:
            head = HEAD.match(text, self._list + 1)
            if not head.group(1):
                # "[1]", "[see" + " ...": not calls, so the "[" is content (and the text after it is looked at again)
                return (self._list + 1, None) if head.end() < len(text) else None
            self._headed = True
        end = self._scanner.advance(text)
        if end is None:
            return None
        return end, python_calls(text[self._list:end])

    def _after(self, text, pos, final):
        i = skip_blank(text, pos)
        if text.startswith(self.end, i):
            return i + len(self.end), None
        if not final and self.end.startswith(text[i:]):
            return None  # all blanks, or the start of <|python_end|>
        return pos, None


class Llama4PythonicToolParser(PythonicToolParser):
    """vLLM's name for Llama 4's calls: the same Python list, which Llama 4 wraps in <|python_start|> and
    <|python_end|> (read above)."""

    name = "llama4_pythonic"
