"""Incremental detokenization that never emits half a UTF-8 character, plus stop-string checks."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded along with the output so the first output token gets its leading space
# right (SentencePiece-style tokenizers drop it when a token is decoded alone).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a character is partial)."""
        self.token_ids.extend(new_token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends in the last `num_new_chars` characters, and where it starts."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop, start)
    return best
