"""The vocabulary grammars are compiled against: the tokenizer's ids, not the model's padded logits."""

from __future__ import annotations


def grammar_vocab_size(tokenizer, model_vocab_size: int) -> int:
    """The tokenizer's id span (its largest id + 1, as xgrammar counts it), at most the model's logits.

    Given a larger vocab_size, xgrammar marks every id past the tokenizer's as a special token, and its
    matcher scans the special tokens' list at every token it accepts: Qwen3-0.6B's 151,936 logits over
    SmolLM2's 49,152-token tokenizer (the structured-outputs benchmark) made accept_token ten times slower
    (20 against 2 us a token on the CPU), and the masks three times wider. The ids past the grammar's
    vocabulary are forbidden by GrammarRows' mask kernel instead, as they were by xgrammar's masks."""
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), max(vocab.values(), default=-1) + 1)
    return min(size, model_vocab_size)
