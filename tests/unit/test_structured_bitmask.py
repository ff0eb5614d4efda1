"""The token bitmask as tokenmill applies it equals xgrammar's own application, bit for bit."""

import torch
import xgrammar as xgr

from tokenmill.structured.matchers import unpack_bitmask


def test_unpacked_bitmask_masks_what_xgrammar_masks():
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(0)
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=generator, dtype=torch.int64).int())
    logits = torch.randn(3, vocab, generator=generator)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    allowed = unpack_bitmask(bitmask, vocab)
    got = logits.masked_fill(~allowed, float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    assert 0 < int(allowed.sum()) < 3 * vocab


def test_a_model_vocab_larger_than_the_tokenizers_is_masked_past_the_tokenizer():
    """Qwen3-0.6B's 151,936 logits under SmolLM2's 49,152-token tokenizer (the structured-outputs benchmark's
    pairing): grammars are compiled against the tokenizer's 49,152 ids (so xgrammar has no 102,784 padding
    ids to scan as special tokens at every accepted token), ids the tokenizer lacks are never allowed, in any
    state, and logits wider still are masked. A stop token past the tokenizer (the model's own EOS here)
    cannot be given to such a grammar: the tokenizer's EOS ends the output."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.structured.compiler import GrammarCompiler

    folder = Path(__file__).resolve().parents[2] / "benchmarks/models/smollm2-tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model_vocab = 151_936
    assert len(tokenizer) == 49_152
    compiler = GrammarCompiler(lambda: tokenizer, model_vocab, num_threads=1)
    try:
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        compiled = compiler.get(StructuredOutputsParams(json=schema))
    finally:
        compiler.shutdown()
    assert compiled.tokenizer_info.vocab_size == 49_152 and len(compiled.tokenizer_info.special_token_ids) < 100
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tokenizer.eos_token_id])
    bitmask = xgr.allocate_token_bitmask(1, 49_152)
    text = json.dumps({"ok": True})  # xgrammar writes ", " and ": " without any_whitespace
    for token in [*tokenizer.encode(text, add_special_tokens=False), None]:
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, model_vocab + 64, 49_152)  # 64 more logits than the model's vocab
        assert allowed.shape == (1, model_vocab + 64)
        assert allowed[0, :49_152].any() and not allowed[0, 49_152:].any()
        if token is not None:
            assert matcher.accept_token(token), tokenizer.decode([token])
    assert allowed[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # at the end: only the stop token
