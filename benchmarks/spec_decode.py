"""Speculative decoding on the GPU: the mechanism's ceiling, the EAGLE-3 head's cost, and speculation under load.

    PYTHONUNBUFFERED=1 python3 benchmarks/spec_decode.py --sections correct,oracle,eagle3_cost,load --out $OUT
    python3 benchmarks/spec_decode.py --smoke --sections oracle,eagle3_cost   # CPU, tiny model: checks it runs

Sections:
  correct      the CPU tests of speculative decoding, run on this device (float32 tiny models: tokens and
               logprobs equal plain decoding's; the rejection sampler's chi-square tests)
  oracle       Llama-3.1-8B (dummy weights), batch 1, 128 prompt / 512 output tokens, greedy: plain decoding
               against an oracle proposer that drafts the target's own greedy continuation of the current
               context (benchmarks/spec_oracle.py, benchmark only: every draft is accepted, so this is the
               ceiling of the verify-and-emit mechanism), k = 2 and 4
  eagle3_cost  the same model and lengths with a dummy-weight EAGLE-3 head in the published Llama-3.1-8B layout
               drafting k = 4 every step: time per engine step (drafting + verifying) against a plain decode
               step (the issue's bound: <= 1.3x); acceptance is meaningless with dummy weights
  eagle3_anatomy  the eagle3_cost run with its host phases timed per step (scheduling, launching, the waits for
               tokens and drafts, the update), and under the torch profiler: the GPU's busy share and idle gaps
  tree_cost    the same model and head: a chain of 4 drafts against draft trees (speculative_token_tree) at batch
               1 and 16: time per engine step (drafting the tree level by level, each level's pass a CUDA graph
               replay; verifying it under the tree mask, in the full-step graphs captured with tree masks) and
               tokens per verifying request-step (meaningless with dummy weights: measure it with a trained
               head); the table says how much more than the chain each tree costs, and so how much more it must
               accept to win
  load         the same model at batch 64 and 256 (128 / 256 tokens, random prompts), plain against n-gram
               speculation configured (k = 4): the draft budget must not make either slower
  W3, W4       BENCHMARKS.md's throughput workloads (benchmarks/gpu_check.py) with and without n-gram speculation
               configured, in subprocesses: within 2% of each other

The oracle: in bfloat16 a verify step's GEMMs round differently from a one-token step's, so a near-tie may go
the other way than in plain decoding. The section first learns the target's greedy continuation of each run's
own context (a few untimed runs, the oracle learning each run's own output), then times runs the oracle drafts
from start to end; its line says how many divergences there were and checks each timed run's tokens against
what the oracle knows. With dummy weights the logits are full of near-ties, so at k = 4 the runs may not settle
(eleventh session: 6 divergences, half the output undrafted); `--dtype float32` rounds ~10^4 times finer, which
leaves far fewer ties to flip (the weights then read twice the bytes: compare speed-ups, not tokens per second).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from spec_oracle import OracleProposer, common_prefix_length, follow_target  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.spec_decode import difference, stats_of  # noqa: E402
from tokenmill.scheduler.draft_budget import DraftBudget  # noqa: E402

LLAMA_8B = str(ROOT / "benchmarks/models/llama-3.1-8b")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
ORACLE_KV_GIB = 4.0
"""The oracle section keeps a plain and a speculative engine side by side: each gets a fixed KV pool."""
EAGLE3_DRAFT_VOCAB = 32000
"""The published Llama-3.1-8B EAGLE-3 head's draft vocabulary (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)."""
RESULTS: dict[str, str] = {}


@dataclass(frozen=True)
class Setup:
    model: str = LLAMA_8B
    dtype: str = "auto"
    prompt_len: int = 128
    output_len: int = 512
    num_runs: int = 3
    kv_cache_space: float | None = None
    """GiB; None: sized from the profiled free memory (GPU)."""
    oracle_wrong_token_at: int | None = None
    """Smoke: the oracle first knows plain decoding's output with this token changed, so that its learning runs
    on the engine (float32 on the CPU never diverges by itself)."""


def smoke_setup(folder: Path) -> Setup:
    """CPU-sized: a 4-layer Llama of width 64 and 32,768 tokens (the EAGLE-3 head's 32,000 are a subset), with
    Llama-3.1-8B's configuration otherwise."""
    config = json.loads(Path(LLAMA_8B, "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32768)
    Path(folder, "config.json").write_text(json.dumps(config))
    return Setup(model=str(folder), dtype="float32", prompt_len=32, output_len=64, num_runs=1, kv_cache_space=0.25,
                 oracle_wrong_token_at=24)


def note(name: str, value: str) -> None:
    RESULTS[name] = value
    print(f"== {name}: {value}", flush=True)


def make_llm(setup: Setup, kv_cache_space: float | None = None, **kwargs) -> LLM:
    return LLM(setup.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, dtype=setup.dtype,
               kv_cache_space=setup.kv_cache_space or kv_cache_space, **kwargs)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release() -> None:
    """Frees the memory of engines the caller has dropped (`del llm` first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(num: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, 30000, length).tolist()} for _ in range(num)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    return outputs, time.perf_counter() - start


def fresh_budget(llm: LLM, k: int, measured_cost: bool = True) -> None:
    """A new draft budget before each run: its pause state would otherwise carry over from the last run.
    Without the measured cost and gain threshold it drafts k every step."""
    scheduler = llm.engine.core.scheduler
    cost = scheduler.draft_budget.cost if measured_cost else None
    scheduler.draft_budget = DraftBudget(k, cost, None, llm.engine.core.executor.max_verify_tokens,
                                         scheduler.draft_budget.tree_level_sizes)
    if not measured_cost:
        scheduler.draft_budget.min_gain = 0.0


class StepCounter:
    """Counts the engine steps launched (one forward pass each, drafting included)."""

    def __init__(self, llm: LLM) -> None:
        self.count = 0
        executor = llm.engine.core.executor
        execute = executor.execute_model

        def counted(scheduler_output):
            self.count += 1
            return execute(scheduler_output)

        executor.execute_model = counted


def section_correct(setup: Setup) -> None:
    eagle3 = "tests/e2e/test_spec_decode_eagle3.py::"  # chains and draft trees (not its two-rank test)
    tests = ["tests/e2e/test_spec_decode.py",
             eagle3 + "test_an_eagle3_head_whose_first_draft_is_the_target_token_is_always_accepted",
             eagle3 + "test_a_random_eagle3_head_drafts_what_the_head_computes_and_changes_no_token",
             eagle3 + "test_steps_launched_before_the_last_ones_tokens_are_on_the_host_change_no_token",
             "tests/unit/test_rejection_sampler.py",
             "tests/unit/test_ngram_proposer.py", "tests/unit/test_scheduler_properties.py",
             "tests/e2e/test_structured_outputs.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                            capture_output=True, text=True)
    print(result.stdout[-3000:], result.stderr[-2000:])
    note("spec tests on GPU", result.stdout.strip().splitlines()[-1] if result.stdout else f"rc {result.returncode}")


def oracle_run(llm: LLM, k: int, prompts, params) -> tuple[list[int], float]:
    """One speculative run with a fresh draft budget: its output tokens and seconds."""
    fresh_budget(llm, k)
    outputs, seconds = timed_generate(llm, prompts, params)
    return list(outputs[0].outputs[0].token_ids), seconds


def oracle_tokens(llm: LLM, k: int, prompts, params) -> list[int]:
    return oracle_run(llm, k, prompts, params)[0]


def section_oracle(setup: Setup, ks: tuple[int, ...] = (2, 4), max_rounds: int = 6) -> None:
    prompts = random_prompts(1, setup.prompt_len, seed=1)
    prompt, num_out = prompts[0]["prompt_token_ids"], setup.output_len
    params = greedy(num_out)
    plain_llm = make_llm(setup, ORACLE_KV_GIB)
    timed_generate(plain_llm, prompts, params)  # warm-up
    plain_times = []
    for _ in range(setup.num_runs):
        outputs, seconds = timed_generate(plain_llm, prompts, params)
        plain_times.append(seconds)
    reference = list(outputs[0].outputs[0].token_ids)
    del plain_llm
    release()
    plain = float(np.median(plain_times))
    note("oracle: plain batch 1", f"{num_out / plain:.1f} tok/s ({plain * 1e3 / num_out:.3f} ms/token)")
    for k in ks:
        llm = make_llm(setup, ORACLE_KV_GIB, speculative_config={**NGRAM, "num_speculative_tokens": k})
        known = list(reference)
        if setup.oracle_wrong_token_at is not None:
            known[setup.oracle_wrong_token_at] ^= 1
        oracle = OracleProposer([prompt + known])
        llm.engine.core.executor.driver_worker.model_runner.speculative.proposer = oracle
        cost = llm.engine.core.scheduler.draft_budget.cost
        followed = follow_target(oracle, partial(oracle_tokens, llm, k, prompts, params), prompt, max_rounds)
        oracle_run(llm, k, prompts, params)  # warm-up
        oracle.misses = 0
        before = stats_of(llm)
        spec_times, known = [], []
        for _ in range(setup.num_runs):
            got, seconds = oracle_run(llm, k, prompts, params)
            spec_times.append(seconds)
            known.append(oracle.known_prefix(prompt + got) - len(prompt))
        stats = difference(before, stats_of(llm))
        spec = float(np.median(spec_times))
        exact = all(n == num_out for n in known) and oracle.misses == 0
        learnt = "learnt" if followed.converged else "NOT all learnt"
        note(f"oracle: k={k} batch 1",
             f"{num_out / spec:.1f} tok/s = {plain / spec:.2f}x plain; acceptance length "
             f"{stats.mean_acceptance_length:.2f}; {len(followed.divergences)} divergences from what the oracle "
             f"knew, at output positions {followed.divergences} ({learnt} in "
             f"{len(followed.divergences) + followed.converged} untimed runs); timed runs' tokens known to the "
             f"oracle: {known} of {num_out} ({'every one' if exact else 'NOT every one'}), "
             f"{oracle.misses} undrafted steps; equal to plain decoding from the prompt before the first difference: "
             f"{common_prefix_length(got, reference)}; step cost {cost.fixed_s * 1e3:.2f} ms + "
             f"{cost.per_token_s * 1e6:.1f} us/token")
        del llm
        release()


def write_eagle3_head(folder: Path, target: dict, seed: int = 0) -> str:
    """A dummy-weight EAGLE-3 head for the Llama `target` (its config.json) in the layout of the published
    Llama-3.1-8B head: its config.json fields, and `midlayer.*` (q/k/v read embedding and state side by side),
    `fc` over three target layers, `norm`, `lm_head` over a 32,000-token draft vocabulary, `d2t` and `t2d`;
    no `embed_tokens` (the target's is shared). Weights as the engine's dummy ones: small uniform, norms 1."""
    hidden, intermediate = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads, vocab = target["num_attention_heads"], target["num_key_value_heads"], target["vocab_size"]
    head_dim, draft_vocab = hidden // heads, min(EAGLE3_DRAFT_VOCAB, vocab)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
              "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
              "intermediate_size": intermediate, "max_position_embeddings": 2048, "model_type": "llama",
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
              "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
              "use_cache": True, "vocab_size": vocab, "draft_vocab_size": draft_vocab}
    shapes = {
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (intermediate, hidden),
        "midlayer.mlp.up_proj.weight": (intermediate, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, intermediate),
        "fc.weight": (hidden, 3 * hidden),
        "lm_head.weight": (draft_vocab, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.empty(shape).uniform_(-1e-3, 1e-3, generator=generator).half()
               for name, shape in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(hidden, dtype=torch.float16)
    hot = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values  # the draft vocabulary's tokens
    tensors["d2t"] = hot - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, hot, True)
    from safetensors.torch import save_file

    Path(folder, "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(Path(folder, "model.safetensors")))
    return str(folder)


def section_eagle3_cost(setup: Setup, k: int = 4) -> None:
    prompts = random_prompts(1, setup.prompt_len, seed=3)
    params = greedy(setup.output_len)
    with tempfile.TemporaryDirectory() as folder:
        head = write_eagle3_head(Path(folder), json.loads(Path(setup.model, "config.json").read_text()))
        per_step, steps, ahead = {}, {}, {}
        spec = {"speculative_config": {"method": "eagle3", "model": head, "num_speculative_tokens": k}}
        # "eagle3 waiting": every verifying step waits for the last one's tokens on the host (worker/verify_ahead.py)
        for name, extra in (("plain", {}), ("eagle3", spec), ("eagle3 waiting", spec)):
            llm = make_llm(setup, **extra)
            counter = StepCounter(llm)
            drafting = "speculative_config" in extra
            if drafting:
                speculative = llm.engine.core.executor.driver_worker.model_runner.speculative
                speculative.launches_ahead &= name == "eagle3"
                take_drafts_ahead, ahead[name] = speculative.take_drafts_ahead, [0]

                def counting(step, count=ahead[name], take=take_drafts_ahead):
                    count[0] += 1
                    return take(step)

                speculative.take_drafts_ahead = counting
                fresh_budget(llm, k, measured_cost=False)
            timed_generate(llm, prompts, params)  # warm-up
            before = stats_of(llm)
            times, counts = [], []
            for _ in range(setup.num_runs):
                if drafting:
                    fresh_budget(llm, k, measured_cost=False)
                start = counter.count
                _, seconds = timed_generate(llm, prompts, params)
                counts.append(counter.count - start)
                times.append(seconds / counts[-1])
            per_step[name], steps[name] = float(np.median(times)), counts
            stats = difference(before, stats_of(llm))
            if stats is not None and name == "eagle3":
                note(f"eagle3_cost: k={k} drafts", f"{stats.num_draft_tokens} draft tokens in {stats.num_drafts} "
                     f"drafting steps of {sum(counts)} ({stats.num_draft_tokens / max(stats.num_drafts, 1):.2f} "
                     f"per step), acceptance {stats.acceptance_rate:.2f} (dummy weights: meaningless)")
            del llm
            release()
    note(f"eagle3_cost: k={k} batch 1", f"plain {per_step['plain'] * 1e3:.3f} ms/step ({steps['plain']} steps), "
         f"EAGLE-3 drafting {k} + verifying {per_step['eagle3'] * 1e3:.3f} ms/step ({steps['eagle3']} steps, "
         f"{ahead['eagle3'][0]} steps of all its runs launched before the last one's tokens were on the host): "
         f"{per_step['eagle3'] / per_step['plain']:.2f}x a plain step; each step waiting for the last one's tokens: "
         f"{per_step['eagle3 waiting'] * 1e3:.3f} ms/step, {per_step['eagle3 waiting'] / per_step['plain']:.2f}x")


# Host phases HostTimers times: (module, owner (a class, or None for a module's function), name). Nested phases
# count inside their callers' too.
HOST_PHASES = (
    ("tokenmill.worker.model_runner", "ModelRunner", "execute_model"),
    ("tokenmill.worker.pending_output", "PendingOutput", "result"),
    ("tokenmill.worker.request_state", "RequestStates", "land_next_drafts"),
    ("tokenmill.worker.request_state", "RequestStates", "apply"),
    ("tokenmill.worker.speculative", "SpeculativeDecoding", "propose"),
    ("tokenmill.worker.model_runner", None, "prepare_inputs"),
    ("tokenmill.worker.model_runner", "ModelRunner", "_forward"),
    ("tokenmill.worker.speculative", "SpeculativeDecoding", "observe"),
    ("tokenmill.worker.model_runner", "ModelRunner", "_sample"),
    ("tokenmill.sample.state", "SamplingState", "build_metadata"),
    ("tokenmill.worker.speculative", "SpeculativeDecoding", "sample_and_verify"),
    ("tokenmill.sample.sampler", "Sampler", "forward"),
    ("tokenmill.worker.speculative", None, "verify_drafts"),
    ("tokenmill.sample.state", "SamplingState", "record_sampled"),
    ("tokenmill.worker.model_runner", "ModelRunner", "_pending_output"),
    ("tokenmill.worker.speculative", "SpeculativeDecoding", "draft_next"),
    ("tokenmill.spec.draft_model", "DraftModelProposer", "_one_token_steps"),
    ("tokenmill.spec.draft_model", "DraftModelProposer", "_step"),
    ("tokenmill.worker.cuda_graph", "CudaGraphRunner", "run"),
    ("tokenmill.worker.pending_output", "PendingOutput", "add_next_drafts"),
)


class HostTimers:
    """Wall time per engine step in each host phase of HOST_PHASES (by wrapping the calls), the scheduler's and
    the engine's whole step beside them."""

    def __init__(self, llm: LLM) -> None:
        import importlib

        self.seconds: dict[str, float] = {}
        self._restore: list[tuple[object, str, object]] = []
        core = llm.engine.core
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update_from_output")
        self._wrap(llm.engine, "step", "engine step")
        for module_name, owner_name, name in HOST_PHASES:
            module = importlib.import_module(module_name)
            owner = module if owner_name is None else getattr(module, owner_name)
            self._wrap(owner, name, f"{owner_name or module_name.rsplit('.', 1)[1]}.{name}")

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)
        seconds = self.seconds
        seconds[label] = 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, inner))

    def restore(self) -> None:
        for owner, name, inner in reversed(self._restore):
            setattr(owner, name, inner)


def gap_sites(prof, threshold_ms: float = 0.05, top: int = 12) -> list[str]:
    """The GPU's idle gaps over threshold_ms by the kernels before and after them: total ms, count, names."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    sites: dict[tuple[str, str], list[float]] = {}
    end, before = None, ""
    for start, stop, name in kernels:
        if end is not None and (start - end) / 1e3 > threshold_ms:
            sites.setdefault((before[:60], name[:60]), []).append((start - end) / 1e3)
        if end is None or stop > end:
            end, before = stop, name
    ranked = sorted(sites.items(), key=lambda item: -sum(item[1]))[:top]
    return [f"{sum(g):8.1f} ms {len(g):5d}x  {a}  ->  {b}" for (a, b), g in ranked]


def gpu_busy(prof) -> tuple[float, float, list[float]]:
    """(kernel time's union in ms, the trace's wall in ms from first to last kernel, the idle gaps in ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 1.0, []
    busy, gaps, end = 0.0, [], None
    for start, stop in spans:
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end) / 1e3)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e3, (spans[-1][1] - spans[0][0]) / 1e3, gaps


def section_eagle3_anatomy(setup: Setup, k: int = 4) -> None:
    """One EAGLE-3 k = 4 run (as eagle3_cost) with its host phases timed per step, then one under the torch
    profiler: how busy the GPU is and where it idles."""
    prompts = random_prompts(1, setup.prompt_len, seed=3)
    params = greedy(setup.output_len)
    with tempfile.TemporaryDirectory() as folder:
        head = write_eagle3_head(Path(folder), json.loads(Path(setup.model, "config.json").read_text()))
        for name, extra in (("plain", {}), ("eagle3", {"speculative_config": {
                "method": "eagle3", "model": head, "num_speculative_tokens": k}})):
            llm = make_llm(setup, **extra)
            drafting = "speculative_config" in extra
            if drafting:
                fresh_budget(llm, k, measured_cost=False)
            timed_generate(llm, prompts, params)  # warm-up
            counter = StepCounter(llm)
            timers = HostTimers(llm)
            if drafting:
                fresh_budget(llm, k, measured_cost=False)
            _, seconds = timed_generate(llm, prompts, params)
            timers.restore()
            steps = counter.count
            note(f"eagle3_anatomy: {name} host", f"{seconds / steps * 1e3:.3f} ms/step over {steps} steps; per step: "
                 + ", ".join(f"{label} {value / steps * 1e3:.3f} ms" for label, value in timers.seconds.items()))
            if drafting:
                fresh_budget(llm, k, measured_cost=False)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                timed_generate(llm, prompts, params)
            busy, wall, gaps = gpu_busy(prof)
            gaps = np.array(gaps)
            big = gaps[gaps > 0.05] if len(gaps) else gaps
            note(f"eagle3_anatomy: {name} GPU", f"kernels busy {busy:.1f} of {wall:.1f} ms ({busy / wall:.1%}); "
                 f"{len(gaps)} idle gaps, {gaps.sum():.1f} ms; {len(big)} over 50 us: {big.sum():.1f} ms, median "
                 f"{np.median(big) if len(big) else 0:.3f} ms")
            for sort_by in ("self_cpu_time_total", "self_cuda_time_total"):
                print(prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=90), flush=True)
            print("GPU idle gaps over 50 us by the kernels around them:", *gap_sites(prof), sep="\n  ", flush=True)
            del llm, prof, timers, counter
            release()


TREES = {
    "chain 4": None,
    "chain 4 as a tree": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "tree 8 (3/2/2/1)": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0)],
    "tree 16 (4/5/4/3)": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
                          (0, 1, 0), (1, 0, 0), (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0)],
}
"""Drafts of depth 4: a chain (decode CUDA graphs for its verify steps and draft steps), the same chain as a
one-branch tree (the tree path: full-step graphs with tree masks for verifying, a graph per level pass for
drafting), and two trees."""


def section_tree_cost(setup: Setup, batches: tuple[int, ...] = (1, 16)) -> None:
    params = greedy(setup.output_len)
    with tempfile.TemporaryDirectory() as folder:
        head = write_eagle3_head(Path(folder), json.loads(Path(setup.model, "config.json").read_text()))
        for batch in batches:
            prompts = random_prompts(batch, setup.prompt_len, seed=5)
            per_step = {}
            for name, tree in (("plain", "plain"), *TREES.items()):
                spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 4}
                if tree is not None:
                    spec["speculative_token_tree"] = tree
                drafting = tree != "plain"
                llm = make_llm(setup, **({"speculative_config": spec} if drafting else {}))
                counter = StepCounter(llm)
                if drafting:
                    fresh_budget(llm, 4, measured_cost=False)
                timed_generate(llm, prompts, params)  # warm-up
                before = stats_of(llm)
                times = []
                for _ in range(setup.num_runs):
                    if drafting:
                        fresh_budget(llm, 4, measured_cost=False)
                    start = counter.count
                    _, seconds = timed_generate(llm, prompts, params)
                    times.append(seconds / (counter.count - start))
                per_step[name] = float(np.median(times))
                stats = difference(before, stats_of(llm))
                accepted = "" if stats is None else f", {stats.mean_acceptance_length:.2f} tokens per verifying step"
                note(f"tree_cost: batch {batch} {name}", f"{per_step[name] * 1e3:.3f} ms/step "
                     f"({per_step[name] / per_step['plain']:.2f}x plain{accepted})")
                del llm
                release()


def section_load(setup: Setup) -> None:
    for batch, output_len in ((64, 256), (256, 256)):
        prompts = random_prompts(batch, 128, seed=batch)
        params = greedy(output_len)
        seconds = {}
        for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM})):
            llm = make_llm(setup, **extra)
            timed_generate(llm, prompts[: min(batch, 16)], SamplingParams(temperature=0, max_tokens=16))  # warm-up
            runs = [timed_generate(llm, prompts, params)[1] for _ in range(2)]
            seconds[name] = min(runs)
            stats = llm.engine.last_stats.spec_decoding
            if stats is not None:
                note(f"load: batch {batch} ngram drafts", f"{stats.num_draft_tokens} draft tokens, acceptance "
                     f"{stats.acceptance_rate:.2f}")
            del llm
            release()
        tokens = batch * output_len
        note(f"load: batch {batch}", f"plain {tokens / seconds['plain']:.0f} out tok/s, ngram configured "
             f"{tokens / seconds['ngram']:.0f} ({seconds['plain'] / seconds['ngram']:.3f}x)")


def section_workload(name: str) -> None:
    import gpu_check

    base = [sys.executable, "-m", *gpu_check.WORKLOADS[name]]
    figures = {}
    for label, extra in (("plain", []), ("ngram", ["--speculative-config", json.dumps(NGRAM)])):
        result = subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True, timeout=280)
        line = next((x for x in result.stdout.splitlines() if x.startswith("Throughput")), None)
        spec_line = next((x for x in result.stdout.splitlines() if "acceptance" in x.lower()), "")
        print(f"{name} {label}: {line} {spec_line}", result.stderr[-1500:] if line is None else "")
        if line is not None:
            figures[label] = float(line.split(",")[1].split()[0])  # total tokens/s
    if len(figures) == 2:
        note(f"{name} total tok/s", f"plain {figures['plain']:.0f}, ngram configured {figures['ngram']:.0f} "
             f"({figures['ngram'] / figures['plain']:.3f}x)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="correct,oracle,eagle3_cost,load")
    parser.add_argument("--out", default=None)
    parser.add_argument("--oracle-k", default="2,4", help="draft lengths the oracle section measures")
    parser.add_argument("--oracle-rounds", type=int, default=6,
                        help="most untimed runs in which the oracle learns the target's continuation")
    parser.add_argument("--dtype", default=None, help="the model's dtype for every section (default: auto, bfloat16 "
                        "on the GPU); float32 lets the oracle draft whole outputs (see the module's notes)")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized (sections oracle and eagle3_cost): a tiny "
                        "Llama, float32, 32 in / 64 out, one timed run; the oracle first knows a wrong output "
                        "token 24, which it must learn its way past")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if args.smoke and set(sections) - {"oracle", "eagle3_cost", "eagle3_anatomy", "tree_cost"}:
        raise SystemExit("--smoke runs the sections oracle, eagle3_cost and tree_cost only")
    with tempfile.TemporaryDirectory() as folder:
        setup = smoke_setup(Path(folder)) if args.smoke else Setup()
        if args.dtype is not None:
            setup = replace(setup, dtype=args.dtype)
        for name in sections:
            if name in ("W3", "W4"):
                section_workload(name)
            elif name == "oracle":
                section_oracle(setup, tuple(int(k) for k in args.oracle_k.split(",")), args.oracle_rounds)
            elif name in ("correct", "eagle3_cost", "eagle3_anatomy", "tree_cost", "load"):
                {"correct": section_correct, "eagle3_cost": section_eagle3_cost,
                 "eagle3_anatomy": section_eagle3_anatomy, "tree_cost": section_tree_cost,
                 "load": section_load}[name](setup)
            else:
                raise SystemExit(f"unknown section {name!r}")
    print("\n| measurement | result |\n|---|---|")
    for name, value in RESULTS.items():
        print(f"| {name} | {value} |")
    if args.out:
        Path(args.out, "spec_decode.json").write_text(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
