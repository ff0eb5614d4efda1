"""Structured outputs: grammars (xgrammar) compiled off the critical path, enforced by a token bitmask.

`grammar.py` turns StructuredOutputsParams into xgrammar grammars (and says what is wrong with a bad one);
`compiler.py` compiles them against the model's vocabulary in a thread pool, with a cache shared by
requests of the same spec; `matchers.py` keeps the worker's per-row grammar state and the step's bitmask.
"""
