"""Structural tags through the offline engine on the real default model (issue 18): the model writes free text,
and every tagged part it starts validates against its schema (jsonschema); a strict tool's structural tag (the
hermes parser's) holds the arguments of a call the model starts by itself to the tool's schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.tool_parsers import get_tool_parser

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_TAG = {"type": "tag", "begin": "<person>", "content": {"type": "json_schema", "json_schema": PERSON},
              "end": "</person>"}
DESCRIBE = [{"role": "user", "content": "Describe a fictional person as JSON with a name and an age."}]
# SmolLM2 copies the tag itself here: the trigger comes from the model, not from the grammar.
COPY = [{"role": "user", "content": 'Repeat exactly: <person>{"name": "Ann", "age": 31}</person>'}]
CASES = [  # (messages, structural tag)
    (COPY, {"structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}], "triggers": ["<person>"]}),
    (DESCRIBE, {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text", "max_tokens": 8}, PERSON_TAG]}}),
    (DESCRIBE, {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<person>"],
                                                     "tags": [PERSON_TAG], "at_least_one": True}}),
]


def tagged_parts(text: str) -> list[dict]:
    return [json.loads(part) for part in re.findall(r"<person>(.*?)</person>", text, re.DOTALL)]


def test_tagged_parts_validate(smollm2_llm):
    params = [SamplingParams(temperature=0, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(structural_tag=tag)) for _, tag in CASES]
    outputs = smollm2_llm.chat([messages for messages, _ in CASES], params, use_tqdm=False)
    for out in outputs:
        [sample] = out.outputs
        assert sample.finish_reason == "stop", sample
        parts = tagged_parts(sample.text)
        assert parts, sample.text
        for part in parts:
            jsonschema.validate(part, PERSON)
    assert outputs[0].outputs[0].text.startswith("Repeat exactly: <person>")  # free text before the trigger


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
# One example call, whose arguments the schema refuses ("location"): copied freely, the call would not validate.
FEW_SHOT = [
    {"role": "system", "content": "You answer every question with a tool call."},
    {"role": "user", "content": "What is the weather in Rome?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Rome"}}\n'
                                     '</tool_call>'},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_strict_tool_arguments_follow_the_schema(smollm2_llm):
    hermes = get_tool_parser("hermes")
    strict = StructuredOutputsParams(structural_tag=hermes.structural_tag(TOOLS))
    free, held = smollm2_llm.chat([FEW_SHOT] * 2, [SamplingParams(temperature=0, max_tokens=60),
                                                   SamplingParams(temperature=0, max_tokens=60,
                                                                  structured_outputs=strict)], use_tqdm=False)
    [free_call] = hermes.parse(free.outputs[0].text, TOOLS).tool_calls
    with pytest.raises(jsonschema.ValidationError):  # the model alone copies the example's "location"
        jsonschema.validate(json.loads(free_call.arguments), WEATHER)
    [call] = hermes.parse(held.outputs[0].text, TOOLS).tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_bad_structural_tag_fails_before_anything_is_scheduled(smollm2_llm):
    bad = StructuredOutputsParams(structural_tag={"structures": [{"begin": "<a>", "schema": PERSON, "end": "</a>"}],
                                                  "triggers": ["<b>"]})
    with pytest.raises(ValueError, match="invalid structural tag"):
        smollm2_llm.generate("Hi", SamplingParams(structured_outputs=bad), use_tqdm=False)
