"""Engine logprobs (per position: token id -> Logprob) in OpenAI's two wire formats."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.outputs import Logprob

Decode = Callable[[int], str]
"""One token id -> its text (for prompt tokens, which carry no decoded text of their own)."""

LOGPROB_FLOOR = -9999.0
"""Where -inf logprobs (tokens a structured output, or any mask, rules out) are reported, as vLLM does:
JSON has no infinity (a 500 from the encoder, or -Infinity in a stream that strict parsers refuse)."""


def _wire(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too


def token_id_text(token_id: int) -> str:
    """A token as --return-tokens-as-token-ids names it."""
    return f"token_id:{token_id}"


def _token_text(token_id: int, logprob: Logprob | None, decode: Decode) -> str:
    if decode is token_id_text:
        return token_id_text(token_id)
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def _top(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely alternatives of a position (-1: all of them), most likely first."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return ranked if num == -1 else ranked[:num]


class CompletionLogprobs:
    """The legacy completions format, {tokens, token_logprobs, top_logprobs, text_offset}, built across
    stream chunks (text offsets run on from one chunk to the next). name: how tokens are named (token_id_text, or
    decode, the default); text offsets count the tokens' text either way."""

    def __init__(self, num_top: int, decode: Decode, name: Decode | None = None) -> None:
        self.num_top, self.decode, self.name = num_top, decode, name or decode
        self.offset = 0

    def format(self, token_ids: list[int], entries: list[dict[int, Logprob] | None]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            chosen = entry.get(token_id) if entry is not None else None
            name = _token_text(token_id, chosen, self.name)
            out["tokens"].append(name)
            out["token_logprobs"].append(_wire(chosen.logprob) if chosen is not None else None)
            if entry is None:
                out["top_logprobs"].append(None)
            else:
                top = {_token_text(t, lp, self.name): _wire(lp.logprob) for t, lp in _top(entry, self.num_top)}
                if chosen is not None:
                    top.setdefault(name, _wire(chosen.logprob))
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(name if self.name is self.decode else _token_text(token_id, chosen, self.decode))
        return out


def vllm_prompt_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], num_top: int,
                         decode: Decode) -> list[dict | None]:
    """vLLM's prompt_logprobs field: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's own token and the `num_top` most likely (the engine may have ranked more)."""
    out: list[dict | None] = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = {t for t, _ in _top(entry, num_top)}
        out.append({str(t): {"logprob": _wire(lp.logprob), "rank": lp.rank, "decoded_token": _token_text(t, lp, decode)}
                    for t, lp in entry.items() if t == token_id or t in top})
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, decode: Decode,
                  vocab_bytes: list[bytes] | None = None) -> dict:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}. decode: how tokens are named
    (token_id_text names them by id). vocab_bytes: each token id's own bytes (ServerState.vocab_bytes); None: the
    UTF-8 of its text (of its name, where tokens are named by id and no vocab_bytes are given)."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        content.append({
            **_chat_entry(token_id, chosen, decode, vocab_bytes),
            "top_logprobs": [_chat_entry(t, lp, decode, vocab_bytes) for t, lp in _top(entry, num_top)],
        })
    return {"content": content}


def _chat_entry(token_id: int, logprob: Logprob | None, decode: Decode, vocab_bytes: list[bytes] | None) -> dict:
    text = _token_text(token_id, logprob, decode)
    # A token holding part of a character (an emoji's first bytes) has the text "\ufffd": its bytes are what
    # lets a client join such tokens back into the character, as OpenAI documents the field.
    raw = vocab_bytes[token_id] if vocab_bytes is not None and token_id < len(vocab_bytes) else text.encode("utf-8")
    return {"token": text, "logprob": _wire(logprob.logprob) if logprob is not None else None, "bytes": list(raw)}
