"""Reasoning parsers: the model's text split into reasoning_content and content, whole or streamed.

    parser_class = get_reasoning_parser("deepseek_r1")
    parser_class.split(text) -> (reasoning, content)
    parser = parser_class(); parser.feed(delta) -> (reasoning_delta, content_delta); parser.finish() -> (...)
    parser_class.for_request(chat_template_kwargs) -> the class a request uses, None: no reasoning to split

A new parser is a module here with a ReasoningParser subclass, and one line in _PARSERS; outside tokenmill, a
plugin file (--reasoning-parser-plugin) passes its subclass to register_reasoning_parser.
"""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.base import ReasoningParser
from tokenmill.server.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from tokenmill.server.reasoning_parsers.deepseek_v3 import DeepSeekV3ReasoningParser
from tokenmill.server.reasoning_parsers.glm45 import Glm45ReasoningParser
from tokenmill.server.reasoning_parsers.granite import GraniteReasoningParser
from tokenmill.server.reasoning_parsers.mistral import MistralReasoningParser
from tokenmill.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser

_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser.name: DeepSeekV3ReasoningParser,
    Glm45ReasoningParser.name: Glm45ReasoningParser,
    GraniteReasoningParser.name: GraniteReasoningParser,
    MistralReasoningParser.name: MistralReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}

REASONING_PARSERS: tuple[str, ...] = tuple(sorted(_PARSERS))


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(_PARSERS))}") from None


def register_reasoning_parser(parser_class: type[ReasoningParser]) -> type[ReasoningParser]:
    """Makes a ReasoningParser subclass a parser of --reasoning-parser under its `name` (a plugin file's way in,
    --reasoning-parser-plugin; also a class decorator); a built-in parser of that name is replaced."""
    if not (isinstance(parser_class, type) and issubclass(parser_class, ReasoningParser)) or not parser_class.name:
        raise TypeError(f"register_reasoning_parser takes a ReasoningParser subclass with a `name`, got "
                        f"{parser_class!r}")
    _PARSERS[parser_class.name] = parser_class
    return parser_class


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser", "register_reasoning_parser"]
