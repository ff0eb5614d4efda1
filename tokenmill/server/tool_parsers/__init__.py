"""Tool-call parsers: the model's text in, OpenAI tool calls out, whole (`parse`) or streamed (`feed`).

    parser_class = get_tool_parser("hermes")
    parser_class.parse(text, tools) -> ParsedToolCalls(content, tool_calls)
    parser = parser_class(tools); parser.feed(delta_text) -> [str | ToolCallDelta]; parser.finish() -> [...]

A new parser is a module here with a ToolParser subclass, and one line in _PARSERS; outside tokenmill, a
plugin file (--tool-parser-plugin) passes its subclass to register_tool_parser.
"""

from __future__ import annotations

from tokenmill.server.tool_parsers.base import (
    Delta,
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble,
    make_tool_call_id,
)
from tokenmill.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from tokenmill.server.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from tokenmill.server.tool_parsers.glm45 import Glm45ToolParser
from tokenmill.server.tool_parsers.granite import GraniteToolParser
from tokenmill.server.tool_parsers.hermes import HermesToolParser
from tokenmill.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from tokenmill.server.tool_parsers.llama3_json import Llama3JsonToolParser, Llama4JsonToolParser
from tokenmill.server.tool_parsers.mistral import MistralToolParser
from tokenmill.server.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from tokenmill.server.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from tokenmill.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

_PARSERS: dict[str, type[ToolParser]] = {
    DeepSeekV3ToolParser.name: DeepSeekV3ToolParser,
    DeepSeekV31ToolParser.name: DeepSeekV31ToolParser,
    Glm45ToolParser.name: Glm45ToolParser,
    GraniteToolParser.name: GraniteToolParser,
    HermesToolParser.name: HermesToolParser,
    KimiK2ToolParser.name: KimiK2ToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    Llama4JsonToolParser.name: Llama4JsonToolParser,
    Llama4PythonicToolParser.name: Llama4PythonicToolParser,
    MistralToolParser.name: MistralToolParser,
    Phi4MiniJsonToolParser.name: Phi4MiniJsonToolParser,
    PythonicToolParser.name: PythonicToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
}

TOOL_PARSERS: tuple[str, ...] = tuple(sorted(_PARSERS))


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(_PARSERS))}") from None


def register_tool_parser(parser_class: type[ToolParser]) -> type[ToolParser]:
    """Makes a ToolParser subclass a parser of --tool-call-parser under its `name` (a plugin file's way in,
    --tool-parser-plugin; also a class decorator); a built-in parser of that name is replaced."""
    if not (isinstance(parser_class, type) and issubclass(parser_class, ToolParser)) or not parser_class.name:
        raise TypeError(f"register_tool_parser takes a ToolParser subclass with a `name`, got {parser_class!r}")
    _PARSERS[parser_class.name] = parser_class
    return parser_class


__all__ = ["TOOL_PARSERS", "Delta", "ParsedToolCalls", "ToolCall", "ToolCallDelta", "ToolParser", "assemble",
           "get_tool_parser", "register_tool_parser", "make_tool_call_id"]
