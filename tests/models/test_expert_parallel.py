"""Expert parallelism (enable_expert_parallel) on the CPU (gloo): each tensor-parallel rank holds whole routed
experts, a contiguous range of them, instead of a slice of every expert.

Two ranks give transformers' greedy tokens in float32 (Qwen3-MoE top-3 of 8, Mixtral top-2 of 4, DeepSeek-V3's
grouped sigmoid routing with a shared expert that stays sliced), with async scheduling, chunked prefill and
ngram drafts on; rank 0 holds half the experts, and rank 1 (built in this process as rank 1 of 2) loads
exactly the other half. At the layer level, an uneven split (6 experts over 4 ranks) sums to the one-rank
output, and across data-parallel replicas (processes over gloo: each replica its own tokens, one with none; also
two replicas of two tensor-parallel ranks) the all-to-all exchange gives each rank the one-process layer's
output for its replica's tokens. Too few experts for the
ranks is refused at start-up.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing
from transformers import Qwen3MoeConfig

from tokenmill import LLM, SamplingParams
from tokenmill.cli import make_parser
from tokenmill.cli.args import engine_config_from_args
from tokenmill.config import ModelConfig, ParallelConfig
from tokenmill.distributed import parallel_state
from tokenmill.layers import moe
from tokenmill.layers.moe import FusedMoE, check_expert_parallel, expert_range
from tokenmill.layers.moe_all_to_all import ExpertExchange
from tokenmill.model.loader import load_model

EP_ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128,
                 num_gpu_blocks_override=64, tensor_parallel_size=2, enable_expert_parallel=True,
                 async_scheduling=True, max_num_batched_tokens=24,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
EP_MODELS = ["qwen3-moe", "mixtral", "deepseek-v3"]


def moe_layers(model: torch.nn.Module) -> dict[str, FusedMoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}


@pytest.mark.parametrize("moe_name", EP_MODELS)
def test_two_expert_parallel_ranks_give_transformers_greedy_tokens(references, moe_name):
    ref = references(moe_name)
    llm = LLM(ref.path, **EP_ENGINE)
    try:
        core = llm.engine.core
        assert core.executor.world_size == 2
        layers = moe_layers(core.executor.driver_worker.model)
        assert layers
        for layer in layers.values():  # rank 0: the first half of the experts, each whole
            half, inter = layer.num_experts // 2, layer.intermediate_size_per_partition
            assert layer.expert_parallel and (layer.first_expert, layer.num_local_experts) == (0, half)
            hidden = layer.w13_weight.shape[2]
            assert layer.w13_weight.shape == (half, 2 * inter, hidden)
            assert layer.w2_weight.shape == (half, hidden, inter)
        params = SamplingParams(temperature=0.0, max_tokens=len(ref.expected[0]), ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in ref.prompts], params, use_tqdm=False)
        assert [list(out.outputs[0].token_ids) for out in outputs] == ref.expected
    finally:
        llm.engine.core.shutdown()


@pytest.mark.parametrize("moe_name", EP_MODELS)
def test_rank_one_loads_the_other_half_of_the_experts_whole(references, monkeypatch, moe_name):
    """Built as rank 1 of 2 (the layers read the group when built; loading runs no collective): each FusedMoE
    holds experts E/2..E-1 with every intermediate feature, equal to transformers' tensors."""
    ref = references(moe_name)
    monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.TensorParallelGroup(1, 2))
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)
    model = load_model(ModelConfig(model=ref.path), ref.hf_model.config, torch.device("cpu"), torch.float32)
    hf_state = ref.hf_model.state_dict()
    layers = moe_layers(model)
    assert layers
    for name, layer in layers.items():
        half = layer.num_experts // 2
        assert (layer.first_expert, layer.num_local_experts) == (half, half)
        assert torch.equal(layer.w13_weight, hf_state[f"{name}.gate_up_proj"][half:])  # [gate | up] rows
        assert torch.equal(layer.w2_weight, hf_state[f"{name}.down_proj"][half:])


def test_expert_ranges_cover_every_expert_once():
    assert [expert_range(8, r, 2) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(6, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    with pytest.raises(ValueError, match="expert parallelism over 4 ranks needs at least 4 routed experts; "
                                         "the model has 3"):
        expert_range(3, 0, 4)


def _layer(num_experts: int, top_k: int, hidden: int, inter: int) -> FusedMoE:
    return FusedMoE(num_experts, top_k, hidden, inter, renormalize=True)


def _load(layer: FusedMoE, gate_up: torch.Tensor, down: torch.Tensor, per_expert: bool) -> None:
    """Every expert's tensors, as the checkpoint has them: per expert, or transformers 5's all-experts layout."""
    if not per_expert:
        layer.weight_loader(layer.w13_weight, gate_up, "gate_up", None)
        layer.weight_loader(layer.w2_weight, down, "down", None)
        return
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2, dim=0)
        layer.weight_loader(layer.w13_weight, gate, "gate", e)
        layer.weight_loader(layer.w13_weight, up, "up", e)
        layer.weight_loader(layer.w2_weight, down[e], "down", e)


@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert", "all-experts"])
def test_uneven_expert_split_sums_to_the_one_rank_layer(monkeypatch, per_expert):
    """6 experts, top-3, over 4 ranks (2, 2, 1, 1 experts): the ranks' partial outputs (the all-reduce's
    inputs) sum to the one-rank layer's output; each rank computes only its own experts' share."""
    num_experts, top_k, hidden, inter, num_ranks = 6, 3, 16, 12, 4
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64)
    x = torch.randn(40, hidden, generator=g, dtype=torch.float64)
    logits = torch.randn(40, num_experts, generator=g, dtype=torch.float64)
    torch.set_default_dtype(torch.float64)  # the layers' parameters
    try:
        whole = _layer(num_experts, top_k, hidden, inter)
        _load(whole, gate_up, down, per_expert)
        expected = whole(x, logits)
        monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)
        monkeypatch.setattr(moe, "tp_all_reduce", lambda t: t)  # the partial outputs themselves
        partials = []
        for rank in range(num_ranks):
            monkeypatch.setattr(parallel_state, "_TP_GROUP", parallel_state.TensorParallelGroup(rank, num_ranks))
            layer = _layer(num_experts, top_k, hidden, inter)
            _load(layer, gate_up, down, per_expert)
            first, count = expert_range(num_experts, rank, num_ranks)
            assert layer.missing_weights() == []
            assert layer.w13_weight.shape == (count, 2 * inter, hidden)
            assert torch.equal(layer.w2_weight, down[first : first + count])
            partials.append(layer(x, logits))
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(p.abs().sum() > 0 and not torch.allclose(p, expected) for p in partials)
    torch.testing.assert_close(sum(partials), expected, rtol=1e-12, atol=1e-12)


def _replica_case(replica_tokens: tuple[int, ...], skewed: bool = False, num_experts: int = 7, top_k: int = 3,
                  hidden: int = 16, inter: int = 12):
    """Every replica's inputs (seeded: each process makes the same): experts, and per replica tokens and logits;
    `skewed`: every token routed to the first rank's experts (0 to 2 of 7 over 3 ranks)."""
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64)
    xs = [torch.randn(n, hidden, generator=g, dtype=torch.float64) for n in replica_tokens]
    logits = [torch.randn(n, num_experts, generator=g, dtype=torch.float64) for n in replica_tokens]
    if skewed:
        logits = [logit + torch.tensor([20.0] * top_k + [0.0] * (num_experts - top_k), dtype=torch.float64)
                  for logit in logits]
    return (num_experts, top_k, hidden, inter), gate_up, down, xs, logits


def _replica_process(rank: int, replica_tokens: tuple[int, ...], tp_size: int, tokens_per_step: int, skewed: bool,
                     init_file: str, out_file: str) -> None:
    """Global rank `rank` of len(replica_tokens) replicas of tp_size ranks: its share of the experts, its replica's
    tokens (the same on each of the replica's ranks) exchanged with every other rank; the most rows its experts
    computed at once saved beside its output."""
    replica, tp_rank = divmod(rank, tp_size)
    parallel_state.init_replica_world(replica, len(replica_tokens), f"file://{init_file}", tp_rank, tp_size, 1,
                                      torch.device("cpu"))
    torch.set_default_dtype(torch.float64)
    parallel_state.set_expert_parallel(True)
    shape, gate_up, down, xs, logits = _replica_case(replica_tokens, skewed)
    layer = _layer(*shape)
    _load(layer, gate_up, down, per_expert=True)
    first, count = expert_range(shape[0], rank, len(replica_tokens) * tp_size)
    assert layer.exchange is not None and (layer.first_expert, layer.num_local_experts) == (first, count)
    assert torch.equal(layer.w2_weight, down[first : first + count])
    most_rows = [0]
    experts = layer._local_experts_forward

    def counted_experts(rows, weights, ids):
        most_rows[0] = max(most_rows[0], rows.shape[0])
        return experts(rows, weights, ids)

    layer._local_experts_forward = counted_experts
    ExpertExchange.live, ExpertExchange.tokens_per_step = True, tokens_per_step
    if xs[replica].shape[0]:
        out = layer(xs[replica], logits[replica])
    else:  # the others' rows still go through this rank's experts
        layer.exchange_without_tokens(torch.float64)
        out = torch.empty(0, shape[2])
    torch.save((out, most_rows[0]), f"{out_file}.{rank}")
    parallel_state.destroy_distributed()


@pytest.mark.slow
@pytest.mark.parametrize(("replica_tokens", "tp_size", "tokens_per_step", "skewed"),
                         [((5, 0, 9), 1, 0, False), ((5, 1), 2, 0, False), ((5, 0, 9), 1, 6, True),
                          ((5, 1), 2, 4, False)],
                         ids=["3-replicas", "2-replicas-x-2-ranks", "3-replicas-in-rounds-skewed",
                              "2-replicas-x-2-ranks-in-rounds"])
def test_replicas_exchanging_tokens_give_the_one_process_layer(tmp_path, replica_tokens, tp_size, tokens_per_step,
                                                               skewed):
    """Replica processes over gloo, 7 experts top-3 spread over every rank (3 replicas: 3 / 2 / 2, one replica
    with no tokens; 2 replicas of 2 tensor-parallel ranks: 2 / 2 / 2 / 1, each rank sending its half of its
    replica's tokens, one rank none): every rank's output for its replica's tokens equals the one-process layer's
    (float64). With a step budget (`tokens_per_step`) the exchange goes in rounds (here 5, 3 and 0 of them on the
    three replicas' ranks; 3 and 1 with tensor parallelism), and no rank's experts compute more rows at once than a
    budget's worth of tokens make, even with every token routed to the first rank's experts (`skewed`: 14 x 3 rows
    there in one round)."""
    world_size = len(replica_tokens) * tp_size
    torch.multiprocessing.spawn(_replica_process, nprocs=world_size,
                                args=(replica_tokens, tp_size, tokens_per_step, skewed, str(tmp_path / "init"),
                                      str(tmp_path / "out")))
    shape, gate_up, down, xs, logits = _replica_case(replica_tokens, skewed)
    top_k = shape[1]
    torch.set_default_dtype(torch.float64)
    try:
        whole = _layer(*shape)
        _load(whole, gate_up, down, per_expert=True)
        for rank in range(world_size):
            x, logit = xs[rank // tp_size], logits[rank // tp_size]
            out, most_rows = torch.load(tmp_path / f"out.{rank}")
            assert out.shape == x.shape
            torch.testing.assert_close(out, whole(x, logit), rtol=1e-12, atol=1e-12)
            if tokens_per_step:
                assert most_rows <= tokens_per_step * top_k, (rank, most_rows)
        if skewed:
            # Rounds of 2 tokens a rank; two replicas have tokens: 2 x 2 x 3 rows reach rank 0's experts at once.
            assert torch.load(tmp_path / "out.0")[1] == 12
    finally:
        torch.set_default_dtype(torch.float32)


def test_too_few_experts_for_the_ranks_are_refused_at_start_up(tmp_path):
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1,
                            moe_intermediate_size=32, head_dim=16, architectures=["Qwen3MoeForCausalLM"])
    parallel = ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="needs at least 4 routed experts; the model has 2"):
        check_expert_parallel(config, parallel)
    check_expert_parallel(config, ParallelConfig(tensor_parallel_size=4))  # sliced experts: fine
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError, match="needs at least 4 routed experts"):  # before any rank starts
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cpu", tensor_parallel_size=4,
            enable_expert_parallel=True)


def test_the_flag_has_vllms_spelling():
    args = make_parser().parse_args(["serve", "m", "-tp", "2", "--enable-expert-parallel"])
    assert engine_config_from_args(args).parallel_config.enable_expert_parallel is True
    args = make_parser().parse_args(["serve", "m", "-tp", "2"])
    assert engine_config_from_args(args).parallel_config.enable_expert_parallel is False
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        ParallelConfig(enable_expert_parallel="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("moe_name", ["qwen3-moe", "deepseek-v3"])
def test_expert_parallel_on_two_gpus(references, moe_name):
    """The fused kernel's masked assignments under CUDA graphs: two GPUs with expert parallelism give the
    one-GPU engine's greedy tokens (float32, no tf32: only the order of the ranks' sum differs)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ref = references(moe_name)
    engine = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=128,
                  num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=len(ref.expected[0]), ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in ref.prompts]
    one_gpu = LLM(ref.path, **engine)
    expected = [list(out.outputs[0].token_ids) for out in one_gpu.generate(requests, params, use_tqdm=False)]
    one_gpu.engine.core.shutdown()
    llm = LLM(ref.path, **engine, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        outputs = llm.generate(requests, params, use_tqdm=False)
        assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    finally:
        llm.engine.core.shutdown()
