"""MatcherSet (structured/matcher_set.py) as the grammar process drives it under async scheduling: a request that
stopped had one more step launched before its stop was seen, and that step's token still arrives. Before, it was
offered to the finished matcher: a WARNING "grammar of row N refused token T it had allowed" from the engine and
one from xgrammar for every structured request that ended with its stop token (on every GPU server)."""

import functools
import logging
from pathlib import Path

import numpy as np
import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.matcher_set import MatcherSet

pytest.importorskip("xgrammar")

TOKENIZER = Path(__file__).resolve().parents[2] / "benchmarks/models/smollm2-tokenizer"


@pytest.fixture(scope="module")
def tokenizer_and_compiler():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    compiler = GrammarCompiler(functools.partial(AutoTokenizer.from_pretrained, TOKENIZER), len(tokenizer),
                               num_threads=1)
    yield tokenizer, compiler
    compiler.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_token_after_the_stop_token_is_not_offered(tokenizer_and_compiler, backend, caplog, capfd):
    tokenizer, compiler = tokenizer_and_compiler
    eos = tokenizer.eos_token_id
    matchers = MatcherSet()
    for row in (0, 1):
        matchers.add(row, compiler.get(StructuredOutputsParams(choice=["yes", "no"], backend=backend)), [eos])
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    with caplog.at_level(logging.WARNING):
        matchers.accept(np.array([0, 1]), np.array([1, 1]), np.array([yes[0], yes[0]]))
        matchers.accept(np.array([0, 1]), np.array([1, 1]), np.array([eos, newline]))  # row 1: a real refusal
        matchers.accept(np.array([0]), np.array([1]), np.array([newline]))  # row 0's step launched past its stop
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"grammar of row 1 refused token {newline} it had allowed"], warnings
    assert "terminated" not in capfd.readouterr().err
