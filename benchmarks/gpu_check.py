"""GPU check: correctness first (kernels, tiny models vs transformers, CUDA graphs vs eager), then timings.

Run from the repository root on the GPU machine:

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

Sections (--sections, comma-separated; the default is env,kernels,models,kbench,W1,W2,W3,W4):
  env          GPU, versions, measured copy bandwidth and bf16 matmul rate (the ceilings)
  kernels      pytest tests/kernels, then the worst paged-attention error against float64
  models       tiny random models of every architecture, float32: greedy tokens == transformers with CUDA
               graphs + async scheduling, eager, chunked prefill, and async scheduling off; bfloat16 (Llama,
               Qwen3): teacher-forced log-probabilities and argmax against transformers (check_bf16)
  kbench       decode / prefill attention timings (--sweep: several tile configurations, and every split
               count with every tile configuration at small batches)
  W1..W4       the workloads of BENCHMARKS.md, each `python -m tokenmill.bench.latency|throughput` in a
               subprocess (W5, start-up, is read from their logs)
  engine       the engine tests whose mechanisms differ on the GPU (async scheduling, forked samples)
  sampler      benchmarks/sampler_overhead.py: the sampler's share of a decode step at batch 256
  skinny       benchmarks/skinny_gemm.py: Llama-8B decode GEMMs at 1 and 8 rows, cuBLAS against Triton
  gemv-tables  the decode GEMVs' tiles with splits of K swept, written where the engine reads them
               (tokenmill/kernels/configs: skinny_gemm_<device>.json, int_gemv_<device>.json); run W1 and
               W1-int4 before (without the tables) and after in the same call
  steps        benchmarks/step_anatomy.py: W3 step by step (host stages, time the host waits for the GPU)
  pdl          programmatic dependent launch (kernels.pdl): benchmarks/weight_read_floor.py, then W1-int4 and W1
               with TOKENMILL_PDL=0 and 1
  anatomy8b, anatomy8b-int4, anatomy06b
               where a decode step's time goes: graph replay alone, the kernels in it (torch profiler),
               and cProfile of the host
The last lines printed are a table of everything measured; --out gets results.json. Everything takes more
than one 10-minute device call: split the sections over calls.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

LLAMA_8B = str(ROOT / "benchmarks/models/llama-3.1-8b")
LLAMA_8B_INT4 = str(ROOT / "benchmarks/models/llama-3.1-8b-gptq-int4")  # its config with GPTQ int4 g128 (issue 19)
QWEN3_06B = str(ROOT / "benchmarks/models/qwen3-0.6b")
DUMMY = ["--load-format", "dummy"]

WORKLOADS = {
    "W1": ["tokenmill.bench.latency", "--model", LLAMA_8B, *DUMMY, "--batch-size", "1", "--input-len", "128",
           "--output-len", "512", "--num-iters", "3", "--num-iters-warmup", "1"],
    "W2": ["tokenmill.bench.latency", "--model", LLAMA_8B, *DUMMY, "--batch-size", "8", "--input-len", "32",
           "--output-len", "128", "--num-iters", "5", "--num-iters-warmup", "2"],
    "W3": ["tokenmill.bench.throughput", "--model", QWEN3_06B, *DUMMY, "--num-prompts", "256",
           "--input-len-range", "100", "1024", "--output-len-range", "100", "1024"],
    "W4": ["tokenmill.bench.throughput", "--model", LLAMA_8B, *DUMMY, "--num-prompts", "1000",
           "--input-len", "1024", "--output-len", "128"],
}
# Quantized variants (issue 19): the same commands with one engine flag more.
WORKLOADS["W1-fp8"] = [*WORKLOADS["W1"], "--quantization", "fp8"]
WORKLOADS["W1-int4"] = [arg if arg != LLAMA_8B else LLAMA_8B_INT4 for arg in WORKLOADS["W1"]]
WORKLOADS["W4-fp8"] = [*WORKLOADS["W4"], "--quantization", "fp8"]
WORKLOADS["W3-fp8kv"] = [*WORKLOADS["W3"], "--kv-cache-dtype", "fp8"]
WORKLOADS["W3-int8kv"] = [*WORKLOADS["W3"], "--kv-cache-dtype", "int8"]
# The multiprocess executor with one rank (issue 20: its cost against the in-process one must stay under 2%).
WORKLOADS["W1-mp"] = [*WORKLOADS["W1"], "--distributed-executor-backend", "mp"]
WORKLOADS["W3-mp"] = [*WORKLOADS["W3"], "--distributed-executor-backend", "mp"]
SUMMARY: list[tuple[str, str]] = []
RESULTS: dict = {}


def note(name: str, value: str) -> None:
    SUMMARY.append((name, value))
    print(f"== {name}: {value}", flush=True)


def section(title: str) -> None:
    print(f"\n######## {title} ########", flush=True)


# ---- environment and ceilings -------------------------------------------------------------------


def check_env() -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    note("device", f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, "
                   f"torch {torch.__version__}, triton {triton.__version__}")
    from triton.testing import do_bench

    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(functools.partial(dst.copy_, src), warmup=50, rep=300, return_mode="median")
    copy_tbs = 2 * src.numel() * 2 / ms / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = do_bench(functools.partial(torch.matmul, a, b), warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192**3 / ms_mm / 1e9
    RESULTS["ceilings"] = {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": tflops}
    note("ceilings", f"D2D copy {copy_tbs:.2f} TB/s (read+write), bf16 8192^3 matmul {tflops:.0f} TFLOP/s")
    del src, dst, a, b
    torch.cuda.empty_cache()


# ---- kernels --------------------------------------------------------------------------------------


def run_pytest(label: str, *args: str) -> None:
    """pytest in a subprocess; its last line goes to the summary, its output to the log when it fails."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-6000:], proc.stderr[-3000:])
    note(label, f"{tail} (rc {proc.returncode}, {time.perf_counter() - start:.0f} s)")


def check_kernels() -> None:
    run_pytest("pytest tests/kernels", "-x", "-n", "8", "tests/kernels")

    import cases

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        worst = 0.0
        for seed, (heads, kv, hd, bs) in enumerate([(32, 8, 128, 16), (12, 4, 80, 8)]):
            case = cases.make_paged_case([1, 300, 1, 1, 57, 2], [2000, 0, 5, 700, 300, 64], heads, kv, hd, bs,
                                         dtype, "cuda", seed)
            for opts in ({}, {"sliding_window": 100}, {"logits_soft_cap": 10.0}):
                worst = max(worst, cases.run_paged_attention(case, **opts))
                worst = max(worst, cases.run_paged_attention(case, num_splits=7, **opts))
        rows.append((str(dtype).removeprefix("torch."), worst))
    note("paged attention max rel err vs float64",
         ", ".join(f"{d} {e:.1e} (tol {cases.TOLERANCE[getattr(torch, d)]:.0e})" for d, e in rows))


def check_engine() -> None:
    """The engine tests whose mechanisms differ on the GPU (async scheduling, forked samples' block copies,
    the fused sampler, ids reused while a step is in flight, the core process and its restart), run on the GPU."""
    run_pytest("pytest engine tests on the GPU", "tests/e2e/test_async_scheduling.py",
               "tests/e2e/test_forked_samples.py", "tests/e2e/test_request_ids.py", "tests/e2e/test_prefix_caching.py",
               "tests/e2e/test_engine_loop.py", "tests/e2e/test_async_engine.py")


def run_script(path: str, timeout: float, *args: str) -> None:
    """A benchmark script of this folder in a subprocess; its last lines go to the summary."""
    path_dirs = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]  # the device's wheels stay on it
    proc = subprocess.run([sys.executable, path, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(path_dirs)})
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    print("\n".join(lines[-80:]))
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
    note(Path(path).stem, f"rc {proc.returncode}; " + " | ".join(lines[-6:]))


# ---- tiny models against transformers ------------------------------------------------------------


def _tiny_models():
    spec = importlib.util.spec_from_file_location("models_conftest", ROOT / "tests/models/conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["models_conftest"] = module
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_new,
                         min_new_tokens=num_new)
    return out[0, len(prompt):].tolist()


def _tokenmill_greedy(path: str, prompts: list[list[int]], num_new: int, **kwargs) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, device="cuda", kv_cache_space=1.0, max_num_seqs=16, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


@torch.no_grad()
def check_bf16(name: str, hf, folder: str, sequences: list[list[int]], device: str = "cuda") -> None:
    """bfloat16 against transformers, teacher-forced on float32 greedy sequences. At every position: the
    log-probability of the sequence's next token, whose error against float32 must stay within twice
    transformers' own bfloat16 error; and the argmax, which must be float32's wherever float32's top two
    differ by more than twice that error (a gap bfloat16's rounding cannot close). Random tiny models have
    many near-ties, so free-running greedy sequences part at the first one and say little about the kernels."""
    from tokenmill import LLM, SamplingParams

    def hf_logprobs(model) -> list[torch.Tensor]:
        return [model(torch.tensor([seq], device=device)).logits[0, :-1].float().log_softmax(-1).cpu()
                for seq in sequences]

    ref32, ref16 = hf_logprobs(hf), hf_logprobs(hf.to(torch.bfloat16))  # (converts hf in place)
    llm = LLM(folder, skip_tokenizer_init=True, device=device, kv_cache_space=1.0, dtype="bfloat16")
    outputs = llm.generate([{"prompt_token_ids": seq} for seq in sequences],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    del llm
    gc.collect()
    targets = [torch.tensor(seq[1:]) for seq in sequences]
    hf_err = max((r16.gather(1, t[:, None]) - r32.gather(1, t[:, None])).abs().max().item()
                 for r32, r16, t in zip(ref32, ref16, targets))
    ours_err, decisive, agree, positions = 0.0, 0, 0, 0
    for r32, t, out in zip(ref32, targets, outputs):
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            positions += 1
            ours_err = max(ours_err, abs(entry[t[pos].item()].logprob - r32[pos, t[pos]].item()))
            top2 = r32[pos].topk(2)
            if top2.values[0] - top2.values[1] > 2 * hf_err:
                decisive += 1
                agree += next(tok for tok, lp in entry.items() if lp.rank == 1) == top2.indices[0].item()
    ok = agree == decisive and ours_err <= 2 * hf_err
    note(f"{name} bfloat16 vs transformers (teacher-forced)",
         f"{'ok' if ok else 'FAIL'}: argmax equal at {agree}/{decisive} decisive positions (of {positions}); "
         f"max |logprob error| vs float32 {ours_err:.4f} (transformers bfloat16: {hf_err:.4f})")


def check_models() -> None:
    mc = _tiny_models()
    settings = {
        "graphs": {},
        "eager": {"enforce_eager": True},
        "chunked16": {"max_num_batched_tokens": 16},
        "no-async": {"async_scheduling": False},
    }
    failures, total = [], 0
    for name, spec in mc.TINY_MODELS.items():
        folder = tempfile.mkdtemp(prefix=name)
        hf = mc.build_tiny_model(spec, Path(folder)).to("cuda")
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 23, 30, 17)]
        num_new = 24
        expected = [_hf_greedy(hf, p, num_new) for p in prompts]
        got = {}
        for setting, kwargs in settings.items():
            got[setting] = _tokenmill_greedy(folder, prompts, num_new, dtype="float32", **kwargs)
            total += 1
            if got[setting] != expected:
                failures.append(f"{name}/{setting}")
                print(f"MISMATCH {name}/{setting}:\n  hf  {expected}\n  got {got[setting]}")
        if name not in ("llama", "qwen3-qknorm"):
            del hf
            continue
        print(f"{name}: float32 settings {'ok' if not any(f.startswith(name + '/') for f in failures) else 'FAIL'}",
              flush=True)
        check_bf16(name, hf, folder, [p + e for p, e in zip(prompts, expected)])
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    # Five prompts decode in the size-8 graph: three padding rows.
    note("tiny models float32 greedy == transformers (graphs+async, eager, chunked, no-async)",
         f"{total - len(failures)}/{total} ok" + (f"; FAILED {failures}" if failures else ""))


# ---- kernel timings -------------------------------------------------------------------------------


def bench_kernels(args) -> None:
    import cases
    from triton.testing import do_bench

    from tokenmill.kernels.decode_attention import choose_num_splits, decode_attention
    from tokenmill.kernels.prefill_attention import prefill_attention

    copy_tbs = RESULTS.get("ceilings", {}).get("copy_TBps", 4.3)
    # Decode, W3-like: 256 requests x ~1000 tokens of context, Qwen3-0.6B heads (16 q / 8 kv, 128).
    for batch, ctx, hq, hkv in [(256, 1000, 16, 8), (8, 160, 32, 8), (1, 640, 32, 8), (32, 4000, 32, 8),
                                (32, 1500, 16, 8), (64, 1200, 16, 8)]:  # the last two: W3's tail
        case = cases.make_paged_case([1] * batch, [ctx - 1] * batch, hq, hkv, 128, 16, torch.bfloat16, "cuda", 0)
        qsl, seq_lens = case.tensors()
        ids = torch.arange(batch, dtype=torch.int32, device="cuda")
        out = torch.empty_like(case.query)
        nbytes = batch * ctx * hkv * 128 * 2 * 2
        configs = [None] if batch != 256 or not args.sweep else [
            None, (32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 4, 2), (64, 2, 3)]
        best = None
        for cfg in configs:
            fn = functools.partial(decode_attention, case.query, case.kv_cache, out, qsl, seq_lens, case.block_table,
                                   ids, case.scale, config=cfg)
            ms = do_bench(fn, warmup=20, rep=200, return_mode="median")
            tbs = nbytes / ms / 1e9
            print(f"decode B={batch} ctx={ctx} {hq}/{hkv} cfg={cfg or 'default'}: {ms * 1e3:.1f} us, "
                  f"{tbs:.2f} TB/s ({tbs / copy_tbs * 100:.0f}% of copy)", flush=True)
            best = min(best or (ms, cfg), (ms, cfg), key=lambda x: x[0])
        RESULTS.setdefault("decode", []).append({"batch": batch, "ctx": ctx, "best_us": best[0] * 1e3,
                                                 "best_cfg": best[1]})
        note(f"decode attention B={batch} ctx={ctx}",
             f"{best[0] * 1e3:.1f} us, {nbytes / best[0] / 1e9:.2f} TB/s (best cfg {best[1] or 'default'})")
        del case
    if args.sweep:  # split counts and tiles at small batches (W1, W2, W3's tail): speed against bytes
        for batch, ctx, hq, hkv in [(1, 640, 32, 8), (8, 160, 32, 8), (16, 1800, 16, 8), (32, 1500, 16, 8),
                                    (64, 1200, 16, 8), (128, 1000, 16, 8)]:
            case = cases.make_paged_case([1] * batch, [ctx - 1] * batch, hq, hkv, 128, 16, torch.bfloat16, "cuda", 0)
            qsl, seq_lens = case.tensors()
            ids = torch.arange(batch, dtype=torch.int32, device="cuda")
            out = torch.empty_like(case.query)
            nbytes = batch * ctx * hkv * 128 * 2 * 2
            timings = {}
            chosen = choose_num_splits(batch, hkv, torch.device("cuda"))
            split_counts = sorted({1, 2, 4, 8, 16, chosen})
            for splits in split_counts:
                for cfg in ((64, 4, 3), (32, 4, 3), (64, 4, 2), (128, 4, 2), (64, 8, 3), (32, 4, 4)):
                    fn = functools.partial(decode_attention, case.query, case.kv_cache, out, qsl, seq_lens,
                                           case.block_table, ids, case.scale, num_splits=splits, config=cfg)
                    timings[(splits, cfg)] = do_bench(fn, warmup=10, rep=100, return_mode="median")
            best = min(timings, key=timings.get)
            print(f"decode B={batch} ctx={ctx} {hq}/{hkv}, us by (splits, cfg): "
                  + ", ".join(f"{k}: {t * 1e3:.1f}" for k, t in sorted(timings.items())), flush=True)
            default = timings[(chosen, (64, 4, 3))]
            per_split = ", ".join(f"{n}: {min(t for (s, _), t in timings.items() if s == n) * 1e3:.1f}"
                                  for n in split_counts)
            note(f"decode sweep B={batch} ctx={ctx} {hq}/{hkv}",
                 f"best {timings[best] * 1e3:.1f} us ({nbytes / timings[best] / 1e9:.2f} TB/s) at (splits, cfg) "
                 f"{best}; default ({chosen} splits) {default * 1e3:.1f} us; best per split count {per_split}")
            del case
    # Prefill, W4-like: 8 requests x 1024 new tokens, Llama-3.1-8B heads (32 q / 8 kv, 128), causal.
    case = cases.make_paged_case([1024] * 8, [0] * 8, 32, 8, 128, 16, torch.bfloat16, "cuda", 0)
    qsl, seq_lens = case.tensors()
    ids = torch.arange(8, dtype=torch.int32, device="cuda")
    out = torch.empty_like(case.query)
    flops = 4 * 32 * 128 * 8 * (1024 * 1025 / 2)
    configs = [None] if not args.sweep else [None, (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                             (128, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3)]
    best = None
    for cfg in configs:
        fn = functools.partial(prefill_attention, case.query, case.kv_cache, out, qsl, seq_lens, case.block_table,
                               ids, 1024, case.scale, config=cfg)
        ms = do_bench(fn, warmup=20, rep=200, return_mode="median")
        print(f"prefill 8x1024 32/8 cfg={cfg or 'default'}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.0f} TFLOP/s",
              flush=True)
        best = min(best or (ms, cfg), (ms, cfg), key=lambda x: x[0])
    RESULTS["prefill"] = {"best_us": best[0] * 1e3, "best_cfg": best[1]}
    note("prefill attention 8x1024 causal", f"{best[0] * 1e3:.1f} us, {flops / best[0] / 1e9:.0f} TFLOP/s "
                                            f"(best cfg {best[1] or 'default'})")


# ---- anatomy of a decode step ----------------------------------------------------------------------


def decode_anatomy(model: str, sizes: tuple[int, ...], num_prompts: int, input_len: int, output_len: int) -> None:
    """GPU time of one decode step (graph replay) per batch size and the kernels in it, against the
    wall time per step of a generation of num_prompts x (input_len, output_len), and where the host's
    time goes (cProfile)."""
    from triton.testing import do_bench

    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.offline import host_profile

    name = Path(model).name
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True)
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    def make_prompts(run: int) -> list[dict]:  # new ids every run: no prefix-cache hits
        return [{"prompt_token_ids": [3 + (run * 104729 + i * 7919 + j) % 30000 for j in range(input_len)]}
                for i in range(num_prompts)]

    llm.generate(make_prompts(0), params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(make_prompts(1), SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(make_prompts(2), params, use_tqdm=False)
    total = time.perf_counter() - start
    note(f"{name} {num_prompts}x({input_len} in, {output_len} out)",
         f"{total:.3f} s; prefill {prefill:.3f} s; decode {(total - prefill) / (output_len - 1) * 1e3:.2f} ms/step")
    runner = llm.engine.core.executor.driver_worker.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    copy_tbs = RESULTS.get("ceilings", {}).get("copy_TBps", 4.3)
    for size in sizes:
        graph = runner.cuda_graphs.graphs[size][0]
        ms = do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
        tbs = weight_bytes / ms / 1e9
        note(f"{name} decode graph replay B={size}",
             f"{ms:.3f} ms (weights alone: {tbs:.2f} TB/s, {tbs / copy_tbs * 100:.0f}% of copy)")
    graph = runner.cuda_graphs.graphs[sizes[0]][0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    with host_profile(True, top=22):
        llm.generate(make_prompts(3), params, use_tqdm=False)
    del llm, runner, graph
    gc.collect()
    torch.cuda.empty_cache()


# ---- workloads -------------------------------------------------------------------------------------


def run_workload(workload: str, out_dir: Path, timeout: float, env: dict[str, str] | None = None, *,
                 cwd: Path = ROOT, label: str | None = None) -> dict | None:
    """One workload in a subprocess run in `cwd` (a tree's root); `env`, variables set for it, also names the result
    (e.g. "W1 TOKENMILL_PDL=0") unless `label` does. Returns the result (None if it failed)."""
    name = label or " ".join([workload, *(f"{key}={value}" for key, value in (env or {}).items())])
    json_path = out_dir / f"{name.replace(' ', '_')}.json"
    cmd = [sys.executable, "-m", *WORKLOADS[workload], "--output-json", str(json_path)]
    print("$ " + " ".join(cmd).replace(str(ROOT) + "/", ""), flush=True)
    start = time.perf_counter()
    ready_at = None
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines = []
    try:
        for line in proc.stdout:
            print(f"  [{name} {time.perf_counter() - start:6.1f}s] {line}", end="", flush=True)
            lines.append(line)
            if ready_at is None and line.startswith("engine start-up"):
                ready_at = time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                proc.kill()
                break
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    if proc.returncode != 0 or not json_path.exists():
        note(name, f"FAILED (rc {proc.returncode}) after {time.perf_counter() - start:.0f} s")
        return None
    result = json.loads(json_path.read_text())
    result["process_to_ready_s"] = ready_at
    RESULTS[name] = result
    startup = next((float(m.group(1)) for line in lines if (m := re.match(r"engine start-up: ([\d.]+)", line))), None)
    if "decode_ms_per_token" in result:
        note(name, f"median e2e {result['median_s'] * 1e3:.1f} ms, p99 {result['p99_s'] * 1e3:.1f} ms, "
                   f"decode {result['decode_ms_per_token']:.3f} ms/token, e2e/out-token "
                   f"{result['e2e_ms_per_output_token']:.3f} ms; start-up {startup} s (process {ready_at:.1f} s)")
    else:
        note(name, f"{result['output_tokens_per_s']:.0f} out tok/s, {result['total_tokens_per_s']:.0f} total tok/s, "
                   f"{result['requests_per_s']:.2f} req/s in {result['elapsed_s']:.1f} s; start-up {startup} s "
                   f"(process {ready_at:.1f} s)")
    phases = [line.strip() for line in lines
              if re.search(r"loaded |memory profile|KV cache:|captured|sampler|ready in", line)]
    RESULTS[name]["startup_log"] = phases
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sections", default="env,kernels,models,kbench,W1,W2,W3,W4")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=560, help="skip what would start after this")
    parser.add_argument("--sweep", action="store_true", help="time several kernel configs")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    timeouts = {"W1": 120, "W2": 100, "W3": 100, "W4": 180}
    timeouts.update({f"{name}-{variant}": timeouts[name] for name, variant in
                     (("W1", "fp8"), ("W1", "int4"), ("W4", "fp8"), ("W3", "fp8kv"), ("W3", "int8kv"),
                      ("W1", "mp"), ("W3", "mp"))})
    for sec in args.sections.split(","):
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            note(sec, f"skipped: {elapsed:.0f} s of the {args.budget_s:.0f} s budget used")
            continue
        section(f"{sec} (at {elapsed:.0f} s)")
        try:
            if sec == "env":
                check_env()
            elif sec == "kernels":
                check_kernels()
            elif sec == "models":
                check_models()
            elif sec == "kbench":
                bench_kernels(args)
            elif sec == "engine":
                check_engine()
            elif sec == "sampler":
                run_script("benchmarks/sampler_overhead.py", 180, "--profile")
            elif sec == "skinny":
                run_script("benchmarks/skinny_gemm.py", 240)
            elif sec == "gemv-tables":
                configs = ROOT / "tokenmill/kernels/configs"
                run_script("benchmarks/skinny_gemm.py", 240, "--out", str(configs))
                run_script("benchmarks/w4a16_gemm.py", 200, "--graph-sweep", "--out", str(configs))
                for table in [*configs.glob("skinny_gemm_*.json"), *configs.glob("int_gemv_*.json")]:
                    (out_dir / table.name).write_bytes(table.read_bytes())  # to commit
            elif sec == "steps":
                run_script("benchmarks/step_anatomy.py", timeout=150)
            elif sec == "anatomy8b":
                decode_anatomy(LLAMA_8B, (1, 8), 1, 128, 64)
            elif sec == "anatomy8b-int4":
                decode_anatomy(LLAMA_8B_INT4, (1, 4), 1, 128, 64)
            elif sec == "pdl":
                run_script("benchmarks/weight_read_floor.py", 240)
                for workload in ("W1-int4", "W1"):
                    for pdl in ("0", "1"):
                        run_workload(workload, out_dir, timeouts[workload], env={"TOKENMILL_PDL": pdl})
            elif sec == "anatomy06b":
                decode_anatomy(QWEN3_06B, (256,), 256, 512, 32)
            elif sec in WORKLOADS:
                run_workload(sec, out_dir, min(timeouts[sec], args.budget_s + 30 - elapsed))
        except Exception as exc:  # keep going: one broken section must not hide the others
            import traceback

            traceback.print_exc()
            note(sec, f"ERROR {type(exc).__name__}: {exc}")
    (out_dir / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print("\n######## summary ########")
    for name, value in SUMMARY:
        print(f"{name:>40}: {value}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
