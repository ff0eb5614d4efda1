"""The think-block machine every reasoning parser shares: a start marker, reasoning, an end marker, content
(`<think>` reasoning `</think>` content, Magistral's [THINK] ... [/THINK], Granite's sentences).

`split(text)` answers (reasoning, content), each None when empty; a parser object streams the same thing:
`feed(delta)` and `finish()` answer (reasoning_delta, content_delta), each None when empty. Text that could be
the start of a marker ("</thi") is held back until the next delta shows what it is, and so are the blanks that
start a part until something else follows them: a part that is all blanks ("<think>\n\n</think>") is None.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tokenmill.server.tool_parsers.base import held_suffix

START, END = "<think>", "</think>"


def non_blank(text: str) -> str | None:
    return text if text.strip() else None


def find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of the markers is in `text`, and which (the longest where two start there); (-1, "")."""
    where, found = -1, ""
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (where < 0 or i < where or (i == where and len(marker) > len(found))):
            where, found = i, marker
    return where, found


_OPENED: dict[type, type] = {}
"""Per parser, its variant for an output the prompt left inside the think block (ReasoningParser.after_prompt)."""


class ReasoningParser:
    """Subclasses name their markers (`starts`, `ends`: the first of each is the one the chat template writes,
    the others variants the models also write), say what text not opened by a start marker is
    (`unopened_is_reasoning`) and may refine `split`."""

    name: ClassVar[str] = ""
    starts: ClassVar[tuple[str, ...]] = (START,)
    ends: ClassVar[tuple[str, ...]] = (END,)
    unopened_is_reasoning: ClassVar[bool] = True

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # then "reasoning" or "content"
        self._finished = False
        self._blanks = {"reasoning": "", "content": ""}  # a part's leading blanks, held
        self._started = {"reasoning": False, "content": False}

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any]) -> type[ReasoningParser] | None:
        """The parser of a request rendered with these chat_template_kwargs: this one, or None where they
        turned thinking off so that the whole output is the answer (DeepSeek-V3's `thinking`)."""
        return cls

    @classmethod
    def prompt_ends_reasoning(cls, prompt: str) -> bool:
        """The chat template closed the think block itself (enable_thinking=false): the model answers at once."""
        return prompt.rstrip().endswith(cls.ends)

    @classmethod
    def after_prompt(cls, prompt: str) -> type[ReasoningParser]:
        """The parser of an output whose prompt is `prompt`. One that opened the think block (Qwen3 Thinking-2507's
        template ends with <think>) leaves the output inside it: its text up to the end marker is reasoning, whole
        and streamed alike, also for a parser that takes an unopened text for content (qwen3's, whose stream would
        see no start marker and send everything as content, the end marker too)."""
        if cls.unopened_is_reasoning or not prompt.rstrip().endswith(cls.starts):
            return cls
        if cls not in _OPENED:
            _OPENED[cls] = type(cls.__name__, (cls,), {"unopened_is_reasoning": True, "__module__": cls.__module__,
                                                       "split": classmethod(ReasoningParser.split.__func__)})
        return _OPENED[cls]

    @classmethod
    def split(cls, text: str) -> tuple[str | None, str | None]:
        parser = cls()
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        return (reasoning or "") + (more_reasoning or "") or None, (content or "") + (more_content or "") or None

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        assert not self._finished, "feed after finish"
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        if self._finished:
            return None, None
        out = self._run(final=True)
        self._finished = True
        return out

    def _run(self, final: bool) -> tuple[str | None, str | None]:
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            opened = next((start for start in self.starts if head.startswith(start)), None)
            if opened is not None:
                self._buf, self._state = head[len(opened):], "reasoning"
            elif final or not any(start.startswith(head) for start in self.starts):  # not blanks or a partial start
                self._state = "reasoning" if self.unopened_is_reasoning else "content"
            else:
                return None, None
        if self._state == "reasoning":
            end, marker = find_first(self._buf, self.ends)
            if end >= 0:
                reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(marker):], "content"
            else:
                keep = 0 if final else held_suffix(self._buf, self.ends)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if self._state == "content":
            content, self._buf = self._buf, ""
        return self._part("reasoning", reasoning), self._part("content", content)

    def _part(self, part: str, text: str) -> str | None:
        if not self._started[part]:
            if not text.strip():
                self._blanks[part] += text
                return None
            text, self._blanks[part], self._started[part] = self._blanks[part] + text, "", True
        return text or None
