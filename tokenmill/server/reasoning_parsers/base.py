"""The think-block machine both reasoning parsers share: `<think>` reasoning `</think>` content.

`split(text)` answers (reasoning, content), each None when empty; a parser object streams the same thing:
`feed(delta)` and `finish()` answer (reasoning_delta, content_delta), each None when empty. Text that could be
the start of a tag ("</thi") is held back until the next delta shows what it is, and so are the blanks that
start a part until something else follows them: a part that is all blanks ("<think>\n\n</think>") is None.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.server.tool_parsers.base import held_suffix

START, END = "<think>", "</think>"


def non_blank(text: str) -> str | None:
    return text if text.strip() else None


class ReasoningParser:
    """Subclasses say what text not opened by <think> is (`unopened_is_reasoning`) and may refine `split`."""

    name: ClassVar[str] = ""
    unopened_is_reasoning: ClassVar[bool] = True

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # then "reasoning" or "content"
        self._finished = False
        self._blanks = {"reasoning": "", "content": ""}  # a part's leading blanks, held
        self._started = {"reasoning": False, "content": False}

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
            if head.startswith(START):
                self._buf, self._state = head[len(START):], "reasoning"
            elif final or not (START.startswith(head)):  # not blanks or a partial "<think>"
                self._state = "reasoning" if self.unopened_is_reasoning else "content"
            else:
                return None, None
        if self._state == "reasoning":
            end = self._buf.find(END)
            if end >= 0:
                reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(END):], "content"
            else:
                keep = 0 if final else held_suffix(self._buf, (END,))
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
