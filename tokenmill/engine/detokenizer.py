"""Incremental detokenization that never emits half a UTF-8 character, plus stop-string checks."""

from __future__ import annotations

import functools
import os

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded along with the output so the first output token gets its leading space
# right (SentencePiece-style tokenizers drop it when a token is decoded alone).
_CONTEXT_TOKENS = 5


class AddedTokenJoiner:
    """vLLM's spaces_between_special_tokens=False: an added token (special or not) right after another comes out as
    its own text, without the space some decoders (WordPiece's) put before every token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.added = _added_token_texts(tokenizer)
        self.after_added = False

    def __call__(self, token_id: int, piece: str) -> str:
        text = self.added.get(token_id)
        if text is not None and self.after_added:
            piece = text
        self.after_added = text is not None
        return piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool,
                 dropped_ids: frozenset[int] = frozenset(), joiner: AddedTokenJoiner | None = None):
        """dropped_ids: tokens left out before decoding (special tokens skipped but for some, see make_detokenizer);
        joiner: what spaces_between_special_tokens=False asks of added tokens' text."""
        self.tokenizer = tokenizer
        self.joiner = joiner
        self.skip_special_tokens = skip_special_tokens
        self.dropped_ids = dropped_ids
        self.token_ids = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in dropped_ids]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a character is partial)."""
        # One at a time: text a token completes is out even if a later token of the step starts a character.
        if self.joiner is None:
            return "".join(self._add(token_id) for token_id in new_token_ids)
        return "".join(self.joiner(token_id, self._add(token_id)) for token_id in new_token_ids)

    def _add(self, token_id: int) -> str:
        if token_id in self.dropped_ids:
            return ""
        self.token_ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith("\ufffd"):
            return ""
        start = len(prefix_text)
        if prefix_text.endswith("\ufffd"):
            # The prompt ends inside a character, its bytes shown as U+FFFD: the character the output completes
            # takes its place (same length: it was dropped) and is the output's text.
            start = len(os.path.commonprefix([prefix_text, full_text]))
        if len(full_text) > start:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full_text[start:]
        return ""


class StreamDetokenizer:
    """The same text as IncrementalDetokenizer, one Rust call per token (tokenizers' DecodeStream) instead
    of two full decodes in Python: the frontend detokenizes every stream's every token, and at a hundred
    streams that cost decides how soon each token reaches its client."""

    def __init__(self, backend, prompt_token_ids: list[int], skip_special_tokens: bool,
                 dropped_ids: frozenset[int] = frozenset(), joiner: AddedTokenJoiner | None = None) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.dropped_ids = dropped_ids
        self.joiner = joiner
        # Primed with the prompt's last tokens: the first output token's leading space comes out right.
        self.stream = DecodeStream(ids=[t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in dropped_ids],
                                   skip_special_tokens=skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str:
        if not self.dropped_ids and self.joiner is None:  # every stream's every token: the plain path stays lean
            pieces = [self.stream.step(self.backend, token_id) for token_id in new_token_ids]
            return "".join(piece for piece in pieces if piece)
        pieces = [(token_id, self.stream.step(self.backend, token_id) or "") for token_id in new_token_ids
                  if token_id not in self.dropped_ids]
        if self.joiner is not None:
            return "".join(self.joiner(token_id, piece) for token_id, piece in pieces)
        return "".join(piece for _, piece in pieces)


def make_detokenizer(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool,
    keep_special_token_ids: list[int] | None = None, spaces_between_special_tokens: bool = True,
) -> IncrementalDetokenizer | StreamDetokenizer:
    """The streaming detokenizer where it gives exactly what IncrementalDetokenizer would: a fast tokenizer
    whose decode adds no Python-side clean-up, and a prompt that does not end inside a character (primed
    with such a prompt, DecodeStream would emit the prompt's partial text with the first output token).

    keep_special_token_ids: special tokens whose text stays when skip_special_tokens drops the others (a reasoning
    parser's </think>, which some tokenizers make special): the text is then decoded with special tokens, all
    but these dropped first, as skip_special_tokens itself drops them.

    spaces_between_special_tokens: False joins consecutive added tokens without a space (AddedTokenJoiner); as
    vLLM's, only where special tokens are not skipped."""
    joiner = None if spaces_between_special_tokens or skip_special_tokens else AddedTokenJoiner(tokenizer)
    dropped_ids: frozenset[int] = frozenset()
    if skip_special_tokens and keep_special_token_ids:
        special_ids = _special_ids(tokenizer)
        if not special_ids.isdisjoint(keep_special_token_ids):
            dropped_ids, skip_special_tokens = special_ids.difference(keep_special_token_ids), False
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not _has_decode_stream() or not isinstance(backend, Tokenizer) or not tokenizer.is_fast
            or getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, dropped_ids, joiner)
    context = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in dropped_ids]
    if context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, dropped_ids, joiner)
    return StreamDetokenizer(backend, prompt_token_ids, skip_special_tokens, dropped_ids, joiner)


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids skip_special_tokens drops: added tokens marked special, and the named ones (bos, eos, ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(i for i, token in added.items() if getattr(token, "special", False)) | frozenset(
        tokenizer.all_special_ids)


@functools.lru_cache(maxsize=8)
def _added_token_texts(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    return {i: token.content for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}


@functools.cache
def _has_decode_stream() -> bool:
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=True)  # `ids` (priming) came in tokenizers 0.22
    except (ImportError, TypeError):
        return False
    return True


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends in the last `num_new_chars` characters, and where it starts."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop, start)
    return best
