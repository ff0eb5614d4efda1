"""Host cost per decode step of structured rows, xgrammar against llguidance: MatcherSet.accept (the sampled tokens)
+ MatcherSet.fill (the packed bitmask), every row with its own JSON schema (structured_outputs.make_schemas, less
uniqueItems, which neither backend enforces), a random allowed token sampled per row; medians over STEPS steps.

    python benchmarks/structured_mask_cost.py                  # BATCHES=16,64,256 BACKENDS=xgrammar,guidance
    SAME=1 python benchmarks/structured_mask_cost.py           # every row the same schema
"""
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from structured_outputs import TOKENIZER, make_schemas  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402
from tokenmill.structured.compiler import GrammarCompiler  # noqa: E402
from tokenmill.structured.matcher_set import MatcherSet  # noqa: E402

tok = AutoTokenizer.from_pretrained(TOKENIZER)
V = len(tok)
EOS = [tok.eos_token_id]
STEPS = int(os.environ.get("STEPS", 40))
WARM = 5
batches = [int(b) for b in os.environ.get("BATCHES", "16,64,256").split(",")]
backends = os.environ.get("BACKENDS", "xgrammar,guidance").split(",")
def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "uniqueItems"}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x
schemas = [strip(s) for s in make_schemas(max(batches))]
if os.environ.get("SAME"):
    schemas = [schemas[0]] * len(schemas)
compiler = GrammarCompiler(functools.partial(AutoTokenizer.from_pretrained, TOKENIZER), V, num_threads=2)
rng = np.random.default_rng(0)
for backend in backends:
    params = [StructuredOutputsParams(json=s, backend=backend) for s in schemas]
    for p in params:
        compiler.submit(p)
    compiled = [compiler.get(p) for p in params]
    W = -(-compiler.grammar_vocab_size // 32)
    for B in batches:
        ms = MatcherSet()
        for r in range(B):
            ms.add(r, compiled[r], EOS)
        rows = np.arange(B)
        counts = np.ones(B, dtype=np.int64)
        nd = np.zeros(B, dtype=np.int64)
        bitmask = np.zeros((B, W), dtype=np.int32)
        tacc, tfill = [], []
        tokens = None
        for step in range(STEPS + WARM):
            t0 = time.perf_counter()
            if tokens is not None:
                ms.accept(rows, counts, tokens)
            t1 = time.perf_counter()
            ms.fill(rows, nd, np.zeros(0, np.int64), bitmask)
            t2 = time.perf_counter()
            if step >= WARM:
                tacc.append(t1 - t0)
                tfill.append(t2 - t1)
            # sample: a random allowed non-stop token; a row whose only choice is stop restarts
            bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
            bits[:, EOS] = False
            tokens = np.empty(B, dtype=np.int64)
            for r in range(B):
                allowed = np.flatnonzero(bits[r])
                if len(allowed) == 0:
                    ms.add(r, compiled[r], EOS)  # restart
                    allowed = [tok.encode("{", add_special_tokens=False)[0]]
                tokens[r] = rng.choice(allowed)
        a, f = np.median(tacc) * 1e3, np.median(tfill) * 1e3
        print(f"{backend:9s} B={B:4d} accept {a:7.2f} ms  fill {f:7.2f} ms  total {a + f:7.2f} ms  "
              f"({(a + f) / B * 1e3:.0f} us/row)", flush=True)
compiler.shutdown()
