"""Structured outputs on the GPU: a batch where every request has its own JSON schema, against the same batch
unconstrained; grammar compile times; the token bitmask's cost per step.

    PYTHONUNBUFFERED=1 python3 benchmarks/structured_outputs.py --out $OUT
    python3 benchmarks/structured_outputs.py --smoke          # CPU, tiny sizes: checks the script runs

Model: Qwen3-0.6B with dummy weights (benchmarks/models/qwen3-0.6b), with a real tokenizer: SmolLM2-135M's,
taken from the default model's GGUF and kept in benchmarks/models/smollm2-tokenizer (49,152 tokens, against
the model's 151,936 logits: the ids past the tokenizer are never allowed in a constrained row). Dummy weights
give near-uniform logits, so at temperature 1 a constrained row samples uniformly among the tokens its grammar
allows: the outputs are random, valid JSON; every schema bounds its strings, arrays and numbers, so outputs end.

Sections:
  compile     tokenmill's GrammarCompiler (tokenmill/structured/compiler.py), one schema at a time: p50/p99 over
              the 256 schemas cold (first compile) and cached (the same spec again)
  throughput  256 requests (prompt: the schema in words and JSON) x up to 256 output tokens, temperature 1:
              each request with its own schema (structured), against the same prompts unconstrained with
              ignore_eos. With a grammar the grammar decides the end (EOS is allowed only once the JSON is
              complete; ignore_eos would let a finished matcher run on unconstrained, so it is off there), so
              structured outputs finish early and the batch thins. Throughput is compared as output tokens per
              second, and against two unconstrained runs: 256 x 256 tokens (the brief's), and one where each
              request's max_tokens is the length of its structured output (the same token schedule: the
              like-for-like ratio). The structured batch runs cold (its grammars compile while it runs, in the
              engine's thread pool) and cached (the same schemas again). Every output that finished with
              "stop" must parse with json.loads and validate with jsonschema; outputs cut by max_tokens
              ("length", mid-structure by design) are counted apart.
  mask        the bitmask's cost per step at batch 256, in pieces: the host fill of 256 matchers (xgrammar's
              multi-threaded BatchGrammarMatcher into a pinned buffer on the threads GrammarRows chooses, on
              xgrammar's 'auto' threads, and one row at a time), the batched accept of one token per row, the
              host-to-device copy (pinned and non-blocking: the host's time to queue it, and its time
              synchronized; pageable for reference), and the apply on 256 x 151,936 bfloat16 logits timed with
              CUDA events: tokenmill's Triton kernel (kernels/token_bitmask.py), against the old unpack_bitmask
              + masked_fill and xgrammar's apply_token_bitmask_inplace; matchers are mid-structure (advanced
              through half of each structured output).
  replay      the grammars' host work (accept + fill) at every step of a whole run without the model: each
              matcher samples uniformly among the tokens it allows; grammars compiled against the tokenizer's
              vocabulary (tokenmill's way) and against the model's 151,936 ids (the way before), which must
              draw the same tokens.

The throughput section also times the engine's host work per runner step (structured_probes.py): the runner's wait
for the last step's tokens, the grammars' pieces on the engine's side (send tokens, start, apply: the wait for
the masks, host buffer, copy + kernel queued; with the matchers in the engine's process also their accept and
fill), the whole _sample and execute_model, and per engine step its wall time and the core's wait for the GPU.
On a GPU host the matchers run in a grammar process (structured/grammar_process.py), so their accept and fill
overlap the engine's host work between `start` and the wait for the masks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402
from tokenmill.structured.compiler import GrammarCompiler  # noqa: E402
from tokenmill.structured.matcher_set import MatcherSet, fill_threads  # noqa: E402
from tokenmill.structured.matchers import unpack_bitmask  # noqa: E402 - the old apply

sys.path.insert(0, str(ROOT / "benchmarks"))
from structured_probes import (  # noqa: E402
    GrammarTimer,
    describe_host,
    has_cuda,
    pct,
    profile_run,
    sync,
    timed_generate,
    trace_run,
)

QWEN3_06B = str(ROOT / "benchmarks/models/qwen3-0.6b")
TOKENIZER = str(ROOT / "benchmarks/models/smollm2-tokenizer")
RESULTS: dict[str, str] = {}
DATA: dict = {}  # what one section leaves for the next (the schemas, the structured outputs)


def note(name: str, value: str) -> None:
    RESULTS[name] = value
    print(f"== {name}: {value}", flush=True)


def release() -> None:
    gc.collect()
    if has_cuda():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- schemas

ENTITIES = ["customer", "order", "invoice", "product", "flight booking", "hotel reservation", "support ticket",
            "job posting", "recipe", "movie", "book", "patient visit", "bank transfer", "shipment", "event",
            "employee", "vehicle", "real-estate listing", "weather report", "sports match", "restaurant review",
            "software release", "course", "insurance claim", "device reading", "social post", "podcast episode",
            "museum exhibit", "train ticket", "subscription"]
WORDS = ["id", "name", "title", "status", "priority", "category", "email", "phone", "city", "country", "currency",
         "amount", "price", "quantity", "rating", "score", "count", "age", "year", "duration_minutes", "weight_kg",
         "active", "verified", "paid", "public", "notes", "summary", "description", "tags", "labels", "items",
         "owner", "author", "address", "location", "contact", "metadata", "created", "updated", "due_date", "code",
         "sku", "language", "level", "kind", "color", "size", "discount", "tax_rate", "latitude", "longitude",
         "reference", "comment", "source", "channel", "region", "version", "platform", "genre", "department"]
ENUMS = [["low", "medium", "high", "urgent"], ["open", "pending", "closed"], ["draft", "published", "archived"],
         ["USD", "EUR", "GBP", "JPY", "CHF"], ["small", "medium", "large", "xl"], ["red", "green", "blue", "black"],
         ["economy", "premium", "business", "first"], ["new", "used", "refurbished"], ["en", "fr", "de", "es", "ja"],
         ["beginner", "intermediate", "advanced"], ["email", "phone", "chat", "web"],
         ["north", "south", "east", "west"]]
PATTERNS = [r"^[A-Z]{3}-[0-9]{4}$", r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", r"^[a-z]{3,8}@[a-z]{3,8}\.com$",
            r"^\+[0-9]{8,12}$", r"^v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}$", r"^[A-Z]{2}[0-9]{2}$"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "string", "string", "enum", "pattern", "integer", "integer", "number", "boolean",
                       "nullable", "string_array", "enum_array"])
    if kind == "string":
        return {"type": "string", "minLength": rng.choice([0, 1, 2]), "maxLength": rng.choice([8, 12, 16, 24, 32])}
    if kind == "enum":
        values = rng.choice(ENUMS)
        return {"type": "string", "enum": rng.sample(values, rng.randint(2, len(values)))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.choice([0, 1, -100, 1900])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([10, 100, 1000, 100000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 5, 100, 10000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "nullable":
        return {"anyOf": [{"type": "string", "maxLength": rng.choice([8, 16])}, {"type": "null"}]}
    if kind == "string_array":
        return {"type": "array", "items": {"type": "string", "maxLength": rng.choice([6, 10, 16])},
                "minItems": rng.choice([0, 1]), "maxItems": rng.choice([2, 3, 4])}
    values = rng.choice(ENUMS)
    return {"type": "array", "items": {"type": "string", "enum": values}, "minItems": 1,
            "maxItems": rng.choice([2, 3]), "uniqueItems": False}


def obj(rng: random.Random, depth: int, num: tuple[int, int]) -> dict:
    names = rng.sample(WORDS, rng.randint(*num))
    props = {}
    for name in names:
        roll = rng.random()
        if depth > 0 and roll < 0.15:
            props[name] = obj(rng, depth - 1, (2, 3))
        elif depth > 0 and roll < 0.22:
            props[name] = {"type": "array", "items": obj(rng, 0, (2, 3)), "minItems": 1,
                           "maxItems": rng.choice([2, 3])}
        else:
            props[name] = leaf(rng)
    required = sorted(rng.sample(names, rng.randint(1, len(names))), key=names.index)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(num: int, seed: int = 0) -> list[dict]:
    """`num` distinct (in structure, not only in title) realistic object schemas."""
    rng = random.Random(seed)
    schemas, seen = [], set()
    while len(schemas) < num:
        schema = obj(rng, depth=2, num=(3, 7))
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            schemas.append({"title": rng.choice(ENTITIES), **schema})
    return schemas


def make_prompts(schemas: list[dict]) -> list[str]:
    return [f"Fill in one {s['title']} record as a JSON object. Use this JSON schema:\n{json.dumps(s)}\nJSON:"
            for s in schemas]


# ---------------------------------------------------------------- compile

def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def section_compile(schemas: list[dict], vocab_size: int) -> None:
    compiler = GrammarCompiler(load_tokenizer, vocab_size)
    start = time.perf_counter()
    compiler.get(StructuredOutputsParams(json={"type": "object"}))  # the tokenizer's info, once per engine
    note("compile: first use (tokenizer info + a trivial schema)", f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    params = [StructuredOutputsParams(json=s) for s in schemas]
    cold, cached, failed = [], [], []
    for p in params:
        start = time.perf_counter()
        try:
            compiler.get(p)
        except ValueError as e:
            failed.append(str(e))
        cold.append(time.perf_counter() - start)
    for p in params:
        start = time.perf_counter()
        compiler.submit(p).exception()
        cached.append(time.perf_counter() - start)
    failures = f"; {len(failed)} failed: {failed[0]}" if failed else ""
    note(f"compile: cold, {len(params)} schemas",
         f"p50 {pct(cold, 50) * 1e3:.2f} ms, p99 {pct(cold, 99) * 1e3:.2f} ms, "
         f"max {max(cold) * 1e3:.2f} ms (target p50 <= 20 ms){failures}")
    note("compile: cached (same spec again)", f"p50 {pct(cached, 50) * 1e6:.1f} us, p99 {pct(cached, 99) * 1e6:.1f} us "
         "(target <= 1 ms)")
    DATA["compiler"] = compiler


# ---------------------------------------------------------------- throughput

def tiny_qwen3(folder: Path) -> str:
    """Smoke mode's model: a 2-layer Qwen3 with the real model's 151,936-token vocabulary (dummy weights)."""
    config = json.loads(Path(QWEN3_06B, "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_window_layers=2, max_position_embeddings=4096)
    Path(folder, "config.json").write_text(json.dumps(config))
    return str(folder)


def validate(schemas: list[dict], outputs) -> tuple[int, int, int, list[str]]:
    """(finished with stop, of which failed json.loads or jsonschema, finished by length, first failures)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    stopped, failed, length, why = 0, 0, 0, []
    for schema, out in zip(schemas, outputs):
        completion = out.outputs[0]
        if completion.finish_reason != "stop":
            length += 1
            continue
        stopped += 1
        try:
            value = json.loads(completion.text)
            if jsonschema is not None:
                jsonschema.validate(value, schema)
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            failed += 1
            if len(why) < 3:
                why.append(f"{type(e).__name__}: {str(e)[:120]} in {completion.text[:160]!r}")
    if jsonschema is None:
        why.insert(0, "jsonschema is not installed: only json.loads checked")
    return stopped, failed, length, why


def section_throughput(schemas: list[dict], model: str, output_len: int, max_model_len: int, dtype: str,
                       profile_dir: str | None = None, kv_cache_space: float | None = None,
                       num_timed_runs: int = 2, trace_dir: str | None = None, num_pairs: int = 5) -> None:
    """`num_pairs`: cached-grammar runs, each followed by an unconstrained run of its output lengths (the median
    pair's ratio counts); `num_timed_runs`: of the unconstrained run at full length (the fastest counts)."""
    prompts = make_prompts(schemas)
    llm = LLM(model, load_format="dummy", tokenizer=TOKENIZER, max_model_len=max_model_len, dtype=dtype,
              kv_cache_space=kv_cache_space)
    core = llm.engine.core
    # The worker: behind the executor (or, before it, the core's own).
    runner = (core.executor.driver_worker if hasattr(core, "executor") else core.worker).model_runner
    where = "in the engine's process" if runner.grammar_rows.in_process else "in a grammar process"
    note("host", f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable by this process; matchers {where}, "
         f"filling {len(schemas)} rows on {fill_threads(len(schemas))} xgrammar threads")
    timer = GrammarTimer(runner, core, llm.engine, llm)
    batch = len(schemas)

    def structured(temperature: float = 1.0) -> list[SamplingParams]:
        return [SamplingParams(temperature=temperature, max_tokens=output_len,
                               structured_outputs=StructuredOutputsParams(json=s)) for s in schemas]

    # Warm-up: both paths, with schemas not in the set (so the timed cold run compiles all of its own).
    warm = make_schemas(4, seed=12345)
    llm.generate(make_prompts(warm), [SamplingParams(temperature=1.0, max_tokens=32,
                 structured_outputs=StructuredOutputsParams(json=s)) for s in warm], use_tqdm=False)
    llm.generate(prompts[:16], SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    timer.take()

    runs = {}
    out_cold, seconds = timed_generate(llm, prompts, structured())
    runs["structured, cold grammars"] = (out_cold, seconds, timer.take())
    # Cached grammars against unconstrained requests of the same output lengths, in pairs run one after the other:
    # the host's speed drifts between runs (10% and more within a call), so each pair's ratio is taken and the
    # median pair reported.
    pairs = []
    for _ in range(num_pairs):
        out, seconds = timed_generate(llm, prompts, structured())
        structured_run = out, seconds, timer.take()
        lengths = [len(o.outputs[0].token_ids) for o in out]
        out, seconds = timed_generate(llm, prompts, [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
                                                     for n in lengths])
        pairs.append((structured_run, (out, seconds, timer.take())))
    ratios = [plain[1] / structured_run[1] for structured_run, plain in pairs]  # same tokens: a ratio of times
    median_pair = pairs[int(np.argsort(ratios)[len(ratios) // 2])]
    runs["structured, cached grammars"], runs["unconstrained, structured run's lengths"] = median_pair
    out_s = median_pair[0][0]
    lengths = [len(o.outputs[0].token_ids) for o in out_s]
    plain = [timed_generate(llm, prompts, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True))
             for _ in range(num_timed_runs)]
    timer.take()
    runs[f"unconstrained, {batch} x {output_len}"] = (*min(plain, key=lambda r: r[1]), ([], [], {}))

    rates = {}
    for name, (outputs, seconds, (records, steps, gaps)) in runs.items():
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates[name] = tokens / seconds
        extra = describe_host(records, steps, gaps, seconds)
        note(f"throughput: {name}", f"{tokens} output tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s" + extra)
    note("throughput: structured output lengths", f"mean {np.mean(lengths):.0f}, p50 {pct(lengths, 50):.0f}, "
         f"max {max(lengths)} tokens (max_tokens {output_len})")
    full = rates[f"unconstrained, {batch} x {output_len}"]
    note("ratio: structured, cached grammars", f"{np.median(ratios):.3f}x unconstrained on the same lengths, the "
         f"median of {len(ratios)} pairs ({', '.join(f'{r:.3f}' for r in ratios)}); "
         f"{rates['structured, cached grammars'] / full:.3f}x unconstrained {batch} x {output_len} (tok/s; "
         "target >= 0.95)")
    like = rates["unconstrained, structured run's lengths"]
    note("ratio: structured, cold grammars", f"{rates['structured, cold grammars'] / like:.3f}x the median pair's "
         f"unconstrained run, {rates['structured, cold grammars'] / full:.3f}x unconstrained {batch} x {output_len}")
    for name, outputs in (("cold run", [out_cold]), (f"cached runs ({len(pairs)})", [p[0][0] for p in pairs])):
        counts = [validate(schemas, o) for o in outputs]
        stopped, failed, length = (sum(c[i] for c in counts) for i in range(3))
        why = [w for c in counts for w in c[3]][:3]
        note(f"validate: {name}", f"{stopped} finished with stop, {failed} of them failed json.loads/jsonschema; "
             f"{length} cut by max_tokens" + (f"; {' | '.join(why)}" if why else ""))
    DATA["outputs"] = out_s
    timer.close()
    if profile_dir is not None:
        for name, params in (("structured", structured()),
                             ("unconstrained", [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
                                                for n in lengths])):
            profile_run(llm, prompts, params, name, profile_dir)
    if trace_dir is not None:
        for name, params in (("structured", structured()),
                             ("unconstrained", [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
                                                for n in lengths])):
            trace_run(llm, prompts, params, name, trace_dir)
    del llm, core, runner, timer
    release()


# ---------------------------------------------------------------- mask

def device_ms(fn, iters: int) -> float:
    """Median ms per call: CUDA events on the GPU, the wall clock elsewhere."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        if has_cuda():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def host_ms(fn, iters: int, synchronize: bool = True) -> float:
    """Median host ms per call: until the device is done too, or (synchronize=False) until the call returns."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        if synchronize:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
        sync()
    return float(np.median(times))


def next_allowed(mask_row: np.ndarray, eos: int) -> int:
    """A token the filled mask row allows, other than the stop token where there is one."""
    allowed = np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))
    others = allowed[allowed != eos]
    return int(others[len(others) // 2]) if len(others) else eos


def accept_ms(matchers: list, tokens: list[int], iters: int) -> float:
    """Median ms of one batched accept of a token per matcher (rolled back after each timing)."""
    import xgrammar as xgr

    times = []
    for _ in range(iters):
        start = time.perf_counter()
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        times.append((time.perf_counter() - start) * 1e3)
        for matcher, ok in zip(matchers, accepted):
            if ok:
                matcher.rollback(1)
    return float(np.median(times))


def section_mask(schemas: list[dict], vocab_size: int, iters: int) -> None:
    import xgrammar as xgr

    compiler = DATA.get("compiler") or GrammarCompiler(load_tokenizer, vocab_size)
    tokenizer = load_tokenizer()
    outputs = DATA.get("outputs")
    matchers, depths = [], []
    grammar_vocab = compiler.get(StructuredOutputsParams(json=schemas[0])).tokenizer_info.vocab_size
    for i, schema in enumerate(schemas):
        matcher = xgr.GrammarMatcher(compiler.get(StructuredOutputsParams(json=schema)),
                                     override_stop_tokens=[tokenizer.eos_token_id])
        tokens = list(outputs[i].outputs[0].token_ids) if outputs is not None else []
        tokens = tokens[: len(tokens) // 2]
        depths.append(sum(matcher.accept_token(t) for t in tokens))
        matchers.append(matcher)
    batch = len(matchers)
    device = torch.device("cuda" if has_cuda() else "cpu")
    pinned = has_cuda()
    # The masks span the grammars' vocabulary (the tokenizer's, structured/vocab.py); the kernel forbids the rest.
    bitmask = torch.empty(batch, (grammar_vocab + 31) // 32, dtype=torch.int32, pin_memory=pinned)
    host = bitmask.numpy()  # xgrammar fills it through numpy, as GrammarRows does
    live = [m for m in matchers if not m.is_terminated()]
    threads = fill_threads(len(live))
    batch_matcher = xgr.BatchGrammarMatcher(threads)  # as GrammarRows
    auto_matcher = xgr.BatchGrammarMatcher()  # xgrammar's 'auto' threads, for reference

    def fill_rows():
        for j, m in enumerate(live):
            m.fill_next_token_bitmask(host, j)

    fill_batched = host_ms(lambda: batch_matcher.batch_fill_next_token_bitmask(live, host), iters)
    fill_auto = host_ms(lambda: auto_matcher.batch_fill_next_token_bitmask(live, host), iters)
    fill = host_ms(fill_rows, iters)
    note(f"mask: host fill, {len(live)} rows", f"{fill_batched:.2f} ms/step with xgrammar's BatchGrammarMatcher "
         f"on {threads} threads (tokenmill's way), {fill_auto:.2f} ms on xgrammar's 'auto' threads, {fill:.2f} ms "
         f"one row at a time; matchers {np.mean(depths):.0f} tokens deep on average; masks {grammar_vocab} tokens "
         f"wide (the grammars' vocabulary) for {vocab_size} logits")
    tokens = [next_allowed(host[j], tokenizer.eos_token_id) for j in range(len(live))]
    note(f"mask: host accept, {len(live)} rows", f"{accept_ms(live, tokens, iters):.2f} ms/step (one allowed token "
         "per row, in one batched call)")
    on_device = torch.empty(bitmask.shape, dtype=torch.int32, device=device)
    pageable = bitmask.clone()
    copy_queue = host_ms(lambda: on_device.copy_(bitmask, non_blocking=True), iters, synchronize=False)
    copy_pinned = host_ms(lambda: on_device.copy_(bitmask, non_blocking=True), iters)
    copy = host_ms(lambda: pageable.to(device), iters)
    note(f"mask: copy {tuple(bitmask.shape)} int32 to the device", f"{copy_queue * 1e3:.0f} us to queue pinned and "
         f"non-blocking (tokenmill's way), {copy_pinned * 1e3:.0f} us synchronized; {copy * 1e3:.0f} us pageable "
         "(the old way; it also waits for the work queued before it)")
    dtype = torch.bfloat16 if has_cuda() else torch.float32
    logits = torch.randn(batch, vocab_size, device=device, dtype=dtype)
    index = torch.arange(batch, device=device, dtype=torch.int32)

    def apply_old():  # the old GrammarRows.apply's device part
        allowed = unpack_bitmask(on_device, logits.shape[-1], grammar_vocab)
        rows = index.long()
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def apply_kernel():
        from tokenmill.kernels.token_bitmask import apply_token_bitmask

        apply_token_bitmask(logits, on_device, index, grammar_vocab)

    name = str(dtype).split(".")[-1]
    apply_ms, text = None, ""
    if has_cuda():
        on_device.copy_(bitmask)
        fresh = logits.clone()
        apply_old()
        expected = torch.isinf(logits)
        logits.copy_(fresh)
        apply_kernel()
        same = torch.equal(expected, torch.isinf(logits))
        apply_ms = device_ms(apply_kernel, iters)
        text = f"{apply_ms * 1e3:.0f} us/step tokenmill's Triton kernel ({name}; masks as the old apply's: {same}); "
    old_ms = device_ms(apply_old, iters)
    text += f"{old_ms * 1e3:.0f} us the old unpack_bitmask + masked_fill"
    try:
        # (Its masks leave the ids past the grammars' vocabulary alone: a timing reference only.)
        xgr_ms = device_ms(lambda: xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=grammar_vocab),
                           iters)
        text += f"; xgrammar's apply_token_bitmask_inplace {xgr_ms * 1e3:.0f} us for reference"
    except Exception as e:  # noqa: BLE001 - a reference figure only
        text += f"; xgrammar's apply_token_bitmask_inplace failed: {type(e).__name__}: {str(e)[:100]}"
    note(f"mask: apply on {batch} x {vocab_size} logits (device)", text)
    apply_ms = old_ms if apply_ms is None else apply_ms
    total = fill_batched + copy_queue + apply_ms
    note("mask: total per step", f"{total:.2f} ms (host fill {fill_batched:.2f} + queueing the copy "
         f"{copy_queue:.3f}, overlapping the forward pass; device apply {apply_ms:.3f}); the old way: "
         f"{fill + copy + old_ms:.2f} ms (fill {fill:.2f} + pageable copy {copy:.3f} + apply {old_ms:.3f})")


# ---------------------------------------------------------------- replay

def replay_run(grammars: list, eos: int, max_steps: int) -> tuple[list[int], list[float], list[float], list]:
    """One matcher per grammar, each sampling uniformly among the tokens its mask allows (what dummy weights
    at temperature 1 do) until it samples the stop token: per step, the live rows, the host's seconds to accept
    the last step's tokens (one batched call, as GrammarRows) and to fill the live rows' masks (GrammarRows._fill:
    xgrammar's threads as fill_threads says); and the tokens drawn."""
    import xgrammar as xgr

    vocab = grammars[0].tokenizer_info.vocab_size
    matchers = [xgr.GrammarMatcher(g, override_stop_tokens=[eos]) for g in grammars]
    mask = np.zeros((len(matchers), (vocab + 31) // 32), dtype=np.int32)
    engine_way = MatcherSet()
    rng = np.random.default_rng(0)
    live, tokens = list(range(len(matchers))), None
    rows, accept_s, fill_s, drawn = [], [0.0], [], []
    for _ in range(max_steps):
        if tokens is not None:
            start = time.perf_counter()
            xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], tokens)
            accept_s.append(time.perf_counter() - start)
            live = [i for i, token in zip(live, tokens) if token != eos]
        if not live:
            break
        start = time.perf_counter()
        engine_way._fill([matchers[i] for i in live], mask, range(len(live)))
        fill_s.append(time.perf_counter() - start)
        rows.append(len(live))
        allowed = np.unpackbits(mask[: len(live)].view(np.uint8), axis=1, bitorder="little")
        tokens = [int(rng.choice(np.flatnonzero(allowed[j]))) for j in range(len(live))]
        drawn.append(tokens)
    return rows, accept_s[: len(rows)], fill_s, drawn


def section_replay(schemas: list[dict], vocab_size: int, max_steps: int) -> None:
    """The grammars' host work per step over a whole run, on the host alone (no model): what GrammarRows.apply
    does before its copy and kernel, at every depth of the outputs (the mask section measures mid-output
    only). With the grammars compiled against the tokenizer's vocabulary (structured/vocab.py, tokenmill's way)
    and, for reference, against the model's 151,936 ids (tokenmill's way before: xgrammar then holds 102,784
    padding ids as special tokens, which its matcher scans at every accepted token)."""
    import xgrammar as xgr

    from tokenmill.structured.grammar import build_grammar
    from tokenmill.structured.vocab import grammar_vocab_size

    tokenizer = load_tokenizer()
    schedules = []
    for name, vocab in (("tokenizer's vocabulary", grammar_vocab_size(tokenizer, vocab_size)),
                        ("model's vocabulary", vocab_size)):
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
        grammars = [compiler.compile_grammar(build_grammar(StructuredOutputsParams(json=s))) for s in schemas]
        rows, accept_s, fill_s, drawn = replay_run(grammars, tokenizer.eos_token_id, max_steps)
        schedules.append(drawn)
        rows_array = np.array(rows)
        full = rows_array == rows_array.max()
        note(f"replay: grammars on the {name} ({vocab} ids)",
             f"{sum(rows)} tokens in {len(rows)} steps; at {rows_array.max()} rows accept "
             f"{np.median(np.array(accept_s)[full][1:]) * 1e3:.2f} + fill {np.median(np.array(fill_s)[full]) * 1e3:.2f}"
             f" ms a step (median; fills on {fill_threads(int(rows_array.max()))} threads); over the run accept "
             f"{sum(accept_s) * 1e3:.0f} + fill {sum(fill_s) * 1e3:.0f} ms")
    # The same masks draw the same tokens (one seed): the two vocabularies constrain alike.
    note("replay: the same tokens drawn on both vocabularies", str(schedules[0] == schedules[1]))


# ---------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="compile,throughput,mask,replay")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: a tiny Qwen3 (same vocabulary), 8 requests")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="throughput: cProfile one more structured and unconstrained run (profile_*.txt in --out)")
    parser.add_argument("--trace", action="store_true",
                        help="throughput: torch.profiler over 12 mid-run steps of one more structured and unconstrained"
                             " run (trace_*.json.gz in --out; GPU idle gaps and the host's work during them printed)")
    parser.add_argument("--pairs", type=int, default=None,
                        help="throughput: structured (cached grammars) and unconstrained runs alternated this many "
                             "times; the median pair's ratio counts (default 5; smoke 2)")
    parser.add_argument("--matchers", choices=["auto", "process", "in-process"], default="auto",
                        help="throughput: the grammar matchers in a process of their own or in the engine's (auto: "
                             "structured.matchers.use_grammar_process decides: a process on a GPU with >= 4 CPUs)")
    args = parser.parse_args()
    if args.matchers != "auto":
        import tokenmill.structured.matchers as matchers

        matchers.use_grammar_process = lambda device, wanted=args.matchers == "process": wanted
    num = args.num_requests or (8 if args.smoke else 256)
    output_len = args.output_len or (128 if args.smoke else 256)
    vocab_size = json.loads(Path(QWEN3_06B, "config.json").read_text())["vocab_size"]
    schemas = make_schemas(num)
    note("setup", f"{num} distinct schemas, {output_len} max output tokens, tokenizer {Path(TOKENIZER).name} "
         f"(49,152 tokens) on a {vocab_size}-logit model" + (", smoke (tiny model, CPU)" if args.smoke else ""))
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_qwen3(Path(tmp)) if args.smoke else QWEN3_06B
        for name in args.sections.split(","):
            if name == "compile":
                section_compile(schemas, vocab_size)
            elif name == "throughput":
                # Smoke: a pool for its few requests (the CPU's default 4 GiB is 524,288 blocks of this model's,
                # seconds to set up), and each variant timed once.
                section_throughput(schemas, model, output_len, 4096 if args.smoke else 2048,
                                   "float32" if args.smoke else "auto", (args.out or tmp) if args.profile else None,
                                   kv_cache_space=0.05 if args.smoke else None, num_timed_runs=1 if args.smoke else 2,
                                   trace_dir=(args.out or tmp) if args.trace else None,
                                   num_pairs=args.pairs or (2 if args.smoke else 5))
            elif name == "mask":
                section_mask(schemas, vocab_size, 3 if args.smoke else 50)
            elif name == "replay":
                section_replay(schemas, vocab_size, output_len)
            else:
                raise SystemExit(f"unknown section {name!r}")
    if "compiler" in DATA:
        DATA["compiler"].shutdown()
    print("\n| measurement | result |\n|---|---|")
    for name, value in RESULTS.items():
        print(f"| {name} | {value} |")
    if args.out:
        Path(args.out, "structured_outputs.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
