"""A request's structured outputs -> one StructuredOutputsParams, checked before it reaches the engine.

Three ways to ask, one per request: OpenAI's response_format (json_object, json_schema, and vLLM's
structural_tag), vLLM's structured_outputs object, and vLLM's older top-level guided_json / guided_regex /
guided_choice / guided_grammar / structural_tag. A spec that does not compile (a bad schema, regex or grammar) is a
400 naming the field it came in; compiling it needs no tokenizer and runs off the event loop, as a large schema
takes a while.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.input_processor import InputProcessor
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.errors import bad_request
from tokenmill.server.openai_protocol import SamplingRequest

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "structural_tag": "structural_tag"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    param: str
    """The request field it came from, which a 400 names."""
    note: str = ""
    """Added to a 400's message: how the spec relates to what the request sent, when the server made it."""
    free: bool = False
    """A structural tag that leaves the text free but for its tags (strict tools'): the output may end without one."""


def constraint_of(req: SamplingRequest) -> Constraint | None:
    """The request's structured outputs, or None; a 400 for two ways at once or an unsupported option."""
    ways: list[tuple[str, dict[str, Any]]] = []  # (field, StructuredOutputsParams' kwargs)
    fmt = req.response_format
    if fmt is not None and fmt.type == "structural_tag":
        tag = ({"type": "structural_tag", "format": fmt.format} if fmt.format is not None else
               {"structures": fmt.structures, "triggers": fmt.triggers})
        ways.append(("response_format", {"structural_tag": tag}))
    elif fmt is not None and fmt.type == "json_object":
        ways.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        ways.append(("response_format", {"json": {} if schema is None else schema}))  # {}: any JSON value
    so = req.structured_outputs
    if so is not None:
        if so.model_extra:
            name = sorted(so.model_extra)[0]
            raise bad_request(f"structured_outputs.{name} is not supported by this server yet; use one of json, "
                              f"regex, choice, grammar, structural_tag or json_object", param="structured_outputs")
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "structural_tag": so.structural_tag}
        kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if so.json_object:
            kwargs["json_object"] = True
        ways.append(("structured_outputs", kwargs))
    for alias, name in GUIDED_ALIASES.items():
        if getattr(req, alias) is not None:
            ways.append((alias, {name: getattr(req, alias)}))
    if req.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported: whitespace in JSON output follows the server's "
                          "--structured-outputs-config (disable_any_whitespace)",
                          param="guided_whitespace_pattern")
    if not ways:
        return None
    if len(ways) > 1:
        fields = ", ".join(name for name, _ in ways)
        raise bad_request(f"structured outputs are asked for in more than one way ({fields}); give only one",
                          param=ways[1][0])
    param, kwargs = ways[0]
    try:
        return Constraint(StructuredOutputsParams(**kwargs), param)
    except ValueError as e:
        raise bad_request(str(e), param=param) from e


class GrammarChecker:
    """Compiles specs on a thread of its own (not the tokenizer's: a large schema would hold up every
    prompt's tokenization)."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    async def check(self, constraint: Constraint, input_processor: InputProcessor) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, input_processor.check_structured_outputs,
                                                             constraint.params)
        except ValueError as e:
            raise bad_request(f"{e}{constraint.note}", param=constraint.param) from e

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
