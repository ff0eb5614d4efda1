"""Lone UTF-16 surrogates in a request body.

JSON may spell one as an escape ("\\ud800"), and Python's json module reads it into a str that no
UTF-8 encoder takes: the tokenizer, xgrammar, the cache-salt hash and the response encoder would each
fail on it in their own way (a TypeError, a 500 while rendering the error). So the server refuses
such strings once, at the edge, naming where they are.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})


def printable(text: str) -> str:
    """`text` with any surrogate escaped, so that it can be put in a response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def find_lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(the dotted path of the first string, key or value, at any depth, that holds a surrogate; the
    surrogate, escaped), or None. Iterative: a body may nest deeper than Python's recursion limit."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if (found := _SURROGATE.search(node)) is not None:
                return path, printable(found.group())
        elif isinstance(node, dict):
            for key, item in node.items():
                item_path = f"{path}.{printable(key)}" if path else printable(key)
                stack.append((key, item_path))
                if isinstance(item, (str, dict, list)):
                    stack.append((item, item_path))
        elif isinstance(node, list) and not _SCALARS.issuperset(map(type, node)):
            # Skipped at C speed above when all scalars: a prompt of a million token ids costs ~10 ms.
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(node) if isinstance(item, (str, dict, list)))
    return None
