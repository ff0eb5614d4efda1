"""Expert parallelism across data-parallel replicas, through the real server: `tokenmill serve -dp 2
--enable-expert-parallel` on a tiny seeded random Qwen3-MoE (float32, SmolLM2's tokenizer so that prompts are
text). Each replica holds half of the routed experts (a quarter per rank with -tp 2); every MoE layer sends each
token to the rank holding its experts and back (all-to-all over gloo), the two engine cores stepping in lockstep.

Greedy text must be the one-process offline engine's for requests spread over both replicas at once, with async
scheduling, chunked prefill (a 16-token budget), preemption (a 6-block pool), n-gram drafts and n = 2 on; a
replica left idle while the other works still exchanges every layer; a request reaching an idle engine is
served; constrained requests (regex, choice) match; killing one replica's core stops both (their requests end
with engine_dead, no hang) and both start again together, serving the same text. Two replicas of two
tensor-parallel ranks (also with the second ranks as Ray actors), of two pipeline stages, FP8 experts, and a
DeepSeek-V3-shaped model (latent attention, grouped routing, a shared expert; and drafting with its MTP layer),
give the one-process text too. What cannot go with it yet is refused at start-up.
"""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import RemoteServer, cmdline, descendants
from test_data_parallel import finished, wait_for

from tokenmill.config import EngineConfig

pytestmark = pytest.mark.slow

MODEL = "tiny-moe"
MAX_MODEL_LEN = 64
SERVER_ARGS = ("--served-model-name", MODEL, "-dp", "2", "--enable-expert-parallel", "--dtype", "float32",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "16", "--num-gpu-blocks-override",
               "6", "--async-scheduling", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time",
           "def main():", "The weather today", "Water boils at", "My favourite colour"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory, smollm2_tokenizer) -> str:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    tokenizer = smollm2_tokenizer
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=3, moe_intermediate_size=32, max_position_embeddings=MAX_MODEL_LEN,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            initializer_range=0.2)  # peaked logits: no greedy step is a near tie
    folder = tmp_path_factory.mktemp("tiny-moe")
    Qwen3MoeForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reference(tiny_moe):
    """The one-process engine's greedy texts: 24 tokens per prompt, and 12 for the short ones."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny_moe, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_space=0.05)
    texts = {}
    for max_tokens in (24, 12):
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
        texts[max_tokens] = [output.outputs[0].text for output in outputs]
    return texts


@pytest.fixture(scope="module")
def server(tiny_moe):
    server = RemoteServer(tiny_moe, *SERVER_ARGS)
    yield server
    server.stop()


def preemptions(server: RemoteServer) -> float:
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "tokenmill:num_preemptions_total")


def complete(server: RemoteServer, prompt: str, max_tokens: int, n: int = 1) -> list[str]:
    response = server.openai_client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n,
                                                         temperature=0.0, extra_body={"ignore_eos": True})
    return [choice.text for choice in response.choices]


def test_greedy_text_across_both_replicas_is_the_one_process_engines(server, reference):
    before = finished(server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: complete(server, p, 24, n=2), PROMPTS))
    assert texts == [[text, text] for text in reference[24]]
    after = finished(server)
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)  # both replicas had requests
    assert preemptions(server) > 0  # 8 x 2 samples of ~30 tokens: more than 2 x 6 blocks hold


def test_one_replica_busy_while_the_other_idles(server, reference):
    """One request at a time (the balancer alternates on idle replicas): each step, the idle replica's core
    exchanges every layer without tokens of its own, serving the busy one's rows for its experts."""
    for prompt, expected in zip(PROMPTS[:4], reference[12][:4]):
        assert complete(server, prompt, 12) == [expected]


def test_structured_outputs_while_the_grammars_compile(server):
    """Requests waiting for their grammar hold no forward pass of their replica: it exchanges without tokens
    meanwhile. A random model's text under regexes and choices (each spec new, so each compiles): it matches, on
    both replicas."""
    before = finished(server)

    def constrained(i: int) -> tuple[str, str]:
        pattern = f"(yes|no)-[0-9]{{{i + 1}}}"
        spec = {"regex": pattern} if i % 2 else {"choice": [f"red{i}", f"green{i}", f"blue{i}"]}
        response = server.openai_client().completions.create(
            model=MODEL, prompt=PROMPTS[i], max_tokens=30, temperature=0.0, extra_body={"structured_outputs": spec})
        assert response.choices[0].finish_reason == "stop"
        expected = pattern if i % 2 else f"(red|green|blue){i}"
        return expected, response.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        for expected, text in pool.map(constrained, range(4)):
            assert re.fullmatch(expected, text), (expected, text)
    after = finished(server)
    assert all(after[e] > before[e] for e in ("0", "1")), (before, after)


def test_killing_one_replica_stops_both_and_they_restart_together(server, reference):
    """The last test on the module's server (it kills one of its cores): a server start saved."""
    assert complete(server, PROMPTS[0], 12) == [reference[12][0]]
    cores = engine_cores(server)
    assert len(cores) == 2
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 50, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url("/v1/completions"), json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        os.kill(cores[0], signal.SIGKILL)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "error" in events[-1] or events[-1]["choices"][0]["finish_reason"] == "length"
    # Both cores go (the other waited for the dead one's exchanges), and two new ones start together.
    wait_for(lambda: len(new := engine_cores(server)) == 2 and not set(new) & set(cores), "two new cores", 90)
    wait_for(lambda: httpx.get(server.url("/health")).status_code == 200, "the engine to serve again", 90)
    texts = wait_for(lambda: _try_complete(server), "a completion after the restart", 60)
    assert texts == [reference[12][2]]
    assert "step together: restarting them all" in server.log_tail(100_000)


def _try_complete(server: RemoteServer) -> list[str] | None:
    try:
        return complete(server, PROMPTS[2], 12)
    except Exception:  # the replicas may still be joining
        return None


def engine_cores(server: RemoteServer) -> list[int]:
    return [pid for pid in descendants(server.proc.pid) if "spawn_main" in cmdline(pid)]


def test_replicas_of_two_tensor_parallel_ranks_share_the_experts_over_four(tiny_moe, reference):
    """-dp 2 -tp 2: each of the four ranks holds 2 of the 8 experts; a replica's two ranks each send half of its
    tokens and gather the other half's outputs. Greedy text: the one-process engine's."""
    server = RemoteServer(tiny_moe, *SERVER_ARGS, "-tp", "2")
    try:
        assert len(engine_cores(server)) == 2
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 12), PROMPTS[:4]))
        assert texts == [[text] for text in reference[12][:4]]
    finally:
        server.stop()


def test_replicas_of_two_pipeline_stages_share_each_stages_experts(tiny_moe, reference):
    """-dp 2 -pp 2: each replica's two stages hold one layer each; each stage's MoE layer exchanges with the other
    replica's same stage (4 of 8 experts per rank), the replicas' passes with and without tokens reaching the stages
    in launch order, with two micro-batches in flight. Greedy text: the one-process engine's, with both replicas
    busy at once (async scheduling, chunked prefill, preemption, n-gram drafts, n = 2) and with one of them idle."""
    server = RemoteServer(tiny_moe, *SERVER_ARGS, "-pp", "2")
    try:
        assert len(engine_cores(server)) == 2
        before = finished(server)
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 24, n=2), PROMPTS[:4]))
        assert texts == [[text, text] for text in reference[24][:4]]
        after = finished(server)
        assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
        assert preemptions(server) > 0
        for prompt, expected in zip(PROMPTS[4:6], reference[12][4:6]):  # one at a time: the other replica idles
            assert complete(server, prompt, 12) == [expected]
        assert "share out the routed experts: 2 ranks hold each layer's" in server.log_tail(100_000)
    finally:
        server.stop()


@pytest.fixture
def ray_cluster(monkeypatch):
    """A one-node Ray cluster as a user starts one (`ray start --head`), with 4 logical CPUs for dp 2 x tp 2 ranks,
    joined through RAY_ADDRESS. Its files in a folder of its own (the address Ray remembers for `ray.init()` is
    not this machine's /tmp/ray one, which would outlive it), without token authentication (which RAY_ADDRESS
    does not carry), and stopped with the `ray start --block` process that runs it (`ray stop` would stop every
    Ray instance on the machine)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import threading

    ray = pytest.importorskip("ray")
    from tokenmill.executor.ray_executor import free_port

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    folder = tempfile.mkdtemp(prefix="tmray")  # short: Ray's socket paths live under it
    port = free_port()
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                             f"--port={port}", f"--temp-dir={folder}", "--num-cpus=4", "--include-dashboard=false",
                             "--disable-usage-stats"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    monkeypatch.setenv("RAY_ADDRESS", f"{ray.util.get_node_ip_address()}:{port}")
    started, output = threading.Event(), []

    def read() -> None:  # to the end, so that the head never blocks on a full pipe
        for line in head.stdout:
            output.append(line)
            if "Ray runtime started" in line:  # printed once its node is up (seconds sooner than a probe's ray.init())
                started.set()

    threading.Thread(target=read, daemon=True).start()
    assert started.wait(60) and head.poll() is None, f"the Ray head did not start: {''.join(output)[-2000:]}"
    yield
    head.terminate()
    head.wait(30)
    shutil.rmtree(folder, ignore_errors=True)


def test_replicas_whose_ranks_are_ray_actors_share_the_experts(tiny_moe, reference, ray_cluster):
    """-dp 2 -tp 2 --distributed-executor-backend ray on a running Ray cluster: each replica's second rank is a Ray
    actor, the four ranks meet at a TCP store on this node, and the greedy text is the one-process engine's."""
    server = RemoteServer(tiny_moe, *SERVER_ARGS, "-tp", "2", "--distributed-executor-backend", "ray")
    try:
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 12), PROMPTS[:4]))
        assert texts == [[text] for text in reference[12][:4]]
        assert server.log_tail(10**6).count("2 ranks ready on Ray") == 2
    finally:
        server.stop()


def test_fp8_experts_shared_over_the_replicas(tiny_moe):
    """--quantization fp8 (the experts e4m3, per-row scales, each rank quantizing its own): the one-process FP8
    engine's greedy text."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny_moe, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_space=0.05, quantization="fp8")
    reference = [output.outputs[0].text for output in llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    llm.engine.core.shutdown()
    server = RemoteServer(tiny_moe, *SERVER_ARGS, "--quantization", "fp8")
    try:
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 12), PROMPTS[:4]))
        assert texts == [[text] for text in reference]
    finally:
        server.stop()


def write_tiny_deepseek_v3(folder, tokenizer, mtp: bool = False):
    """DeepSeek-V3's shape (latent attention, a dense first layer, a shared expert, sigmoid scores with a correction
    bias, top-2 of 8 within the best 2 of 4 groups), seeded; `mtp`: with an MTP layer (num_nextn_predict_layers 1)
    made of its last decoder layer's tensors (experts included) and random norms, projection and LM head."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=MAX_MODEL_LEN, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=0.2, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # a correction bias that moves the choice of experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if mtp:
        from test_spec_decode_mtp import add_mtp_layer, checkpoint_tensors

        config.num_nextn_predict_layers = 1
        config.save_pretrained(folder)
        hidden, last, prefix = config.hidden_size, f"model.layers.{config.num_hidden_layers - 1}.", \
            f"model.layers.{config.num_hidden_layers}."
        tensors = {prefix + name.removeprefix(last): t for name, t in checkpoint_tensors(folder).items()
                   if name.startswith(last)}
        generator = torch.Generator().manual_seed(4)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = 1 + 0.2 * torch.randn(hidden, generator=generator)
        tensors[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
        tensors[f"{prefix}shared_head.head.weight"] = torch.randn(config.vocab_size, hidden, generator=generator) * 0.2
        add_mtp_layer(folder, tensors)


def one_process_greedy_text(folder: str, max_tokens: int = 12) -> list[str]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_space=0.05)
    try:
        return [output.outputs[0].text for output in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.engine.core.shutdown()


def test_mtp_drafts_keep_their_experts_within_each_replica(tmp_path, smollm2_tokenizer):
    """DeepSeek-V3's shape with its MTP layer drafting (speculative method mtp), -dp 2: the target's experts are
    shared out over both replicas, the MTP layer's stay whole in each (its passes run when its replica drafts, not
    in step with the other's). Greedy text is the one-process engine's without speculation, on both replicas, and
    drafts were verified. (The shape's latent attention, grouped routing and shared expert under -dp 2 with n-gram
    drafts had a server of their own, which proved no more than this one and the module's server together.)"""
    write_tiny_deepseek_v3(tmp_path, smollm2_tokenizer, mtp=True)
    reference = one_process_greedy_text(str(tmp_path))
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    server = RemoteServer(str(tmp_path), *SERVER_ARGS[:-2], "--speculative-config", mtp)
    try:
        before = finished(server)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 12), PROMPTS))
        assert texts == [[text] for text in reference]
        after = finished(server)
        assert all(after[e] > before[e] for e in ("0", "1")), (before, after)
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        drafted = sum(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                      if s.name == "tokenmill:spec_decode_num_draft_tokens_total")
        assert drafted > 0
    finally:
        server.stop()


def test_replica_configs_keep_the_servers_step_time_target(tiny_moe):
    """`serve` sets target_step_ms when no budget is given; each replica's config keeps it (a new EngineConfig would
    refuse the target with the budget it has resolved since)."""
    from tokenmill.engine.replica_lockstep import replica_configs

    config = EngineConfig.from_kwargs(tiny_moe, data_parallel_size=2, enable_expert_parallel=True, target_step_ms=20)
    configs = replica_configs(config, "/private", 3)
    assert [c.parallel_config.replica_world.replica for c in configs] == [0, 1]
    assert all(c.scheduler_config == config.scheduler_config and c.device_config.enforce_eager for c in configs)
    assert {c.parallel_config.replica_world.init_method for c in configs} == {"file:///private/world-3"}


def test_replicas_with_ray_actors_meet_at_a_tcp_store_on_this_node(tiny_moe):
    """With the ray backend a replica's other ranks are Ray actors, maybe on other nodes: the replicas' world meets
    at this node's address (not in a file of this host's), and every replica's ranks run on Ray alike."""
    pytest.importorskip("ray")
    from tokenmill.engine.replica_lockstep import replica_configs

    config = EngineConfig.from_kwargs(tiny_moe, data_parallel_size=2, tensor_parallel_size=2,
                                      enable_expert_parallel=True, distributed_executor_backend="ray")
    first, again = replica_configs(config, "/private", 0), replica_configs(config, "/private", 1)
    (place,) = {c.parallel_config.replica_world.init_method for c in first}
    assert re.fullmatch(r"tcp://[\d.]+:\d+", place) and place != again[0].parallel_config.replica_world.init_method
    assert {c.parallel_config.distributed_executor_backend for c in first} == {"ray"}


def test_what_cannot_go_with_it_is_refused_at_start_up(tiny_moe):
    from tokenmill.engine.replica_lockstep import replicas_share_experts
    from tokenmill.model.loader import load_hf_config

    def config(**kwargs) -> EngineConfig:
        return EngineConfig.from_kwargs(tiny_moe, data_parallel_size=2, enable_expert_parallel=True, **kwargs)

    hf_config = load_hf_config(config().model_config)
    assert replicas_share_experts(config(), hf_config)
    assert replicas_share_experts(config(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_max": 2}), hf_config)
    assert replicas_share_experts(config(tensor_parallel_size=2), hf_config)  # over dp x tp = 4 ranks
    assert replicas_share_experts(config(pipeline_parallel_size=2), hf_config)  # each stage's over dp x tp
    # A drafter's experts stay within its replica (a mixture-of-experts draft model's too).
    assert replicas_share_experts(config(speculative_config={"method": "draft_model", "model": tiny_moe,
                                                             "num_speculative_tokens": 2}), hf_config)
    assert replicas_share_experts(config(tensor_parallel_size=2, distributed_executor_backend="ray"), hf_config)
    hf_config.num_experts = 3
    with pytest.raises(ValueError, match="expert parallelism over 4 ranks needs at least 4 routed experts"):
        replicas_share_experts(config(tensor_parallel_size=2), hf_config)


@pytest.mark.gpu
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (2, 2)])
def test_replicas_share_the_experts_on_gpus(tiny_moe, dp, tp):
    """NCCL: the exchange on dp x tp GPUs (eager: the replicas run without CUDA graphs) gives the one-GPU engine's
    greedy text (float32, no tf32)."""
    import torch

    from tokenmill import LLM, SamplingParams

    if torch.cuda.device_count() < dp * tp or "CUDA_VISIBLE_DEVICES" in os.environ:
        pytest.skip(f"needs {dp * tp} GPUs, all visible")
    one_gpu = LLM(tiny_moe, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_space=0.5)
    reference = [output.outputs[0].text for output in one_gpu.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    one_gpu.engine.core.shutdown()
    server = RemoteServer(tiny_moe, "--served-model-name", MODEL, "-dp", str(dp), "-tp", str(tp),
                          "--enable-expert-parallel", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                          "--kv-cache-space", "0.5")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: complete(server, p, 12), PROMPTS))
        assert texts == [[text] for text in reference]
        assert all(n > 0 for n in finished(server).values())
    finally:
        server.stop()
