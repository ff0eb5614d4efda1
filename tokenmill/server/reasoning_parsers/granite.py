"""IBM Granite 3.2 and 3.3 with thinking on (chat_template_kwargs {"thinking": true}): no tags but two
sentences, written as plain text,

    Here is my thought process:
    The user asks ...
    Here is my response:
    It is 4.

reasoning between them, content after the second. Quantized models also write "Here's" for "Here is". As for
Qwen3, an output without the second sentence is all content, and a stream decides at its start (see qwen3).
"""

from __future__ import annotations

from tokenmill.server.reasoning_parsers.qwen3 import Qwen3ReasoningParser


class GraniteReasoningParser(Qwen3ReasoningParser):
    name = "granite"
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")
