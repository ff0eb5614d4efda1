"""MTP speculative decoding (DeepSeek-V3's multi-token-prediction layer) through the whole engine: CPU,
float32, the tiny DeepSeek-V3 of tests/models with one MTP layer written into its checkpoint.

Emitted tokens and logprobs equal plain decoding's in every engine mode; a random MTP layer drafts exactly
what a direct computation with transformers' DeepSeek-V3 decoder layer drafts; and an MTP layer built to
recompute a context-free target's last step has every draft accepted.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.e2e.test_spec_decode import (
    ENGINES,
    _Model,
    always_draft,
    check_same_tokens_and_logprobs,
    run,
    tokens_drafts_and_acceptances,
    workload,
)
from tests.e2e.test_spec_decode_eagle3 import proposer_of, record_proposals, rms_norm
from tests.models.conftest import TINY_MODELS, build_tiny_model
from tokenmill import LLM

SPEC = dataclasses.replace(TINY_MODELS["deepseek-v3"],
                           overrides={**TINY_MODELS["deepseek-v3"].overrides, "num_nextn_predict_layers": 1})
MTP = "model.layers.2."  # the tiny model has 2 decoder layers: its MTP layer is layer 2


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


def add_mtp_layer(folder, tensors: dict[str, torch.Tensor], own_shard: bool = False) -> None:
    """Add `tensors` (names under model.layers.2.) to the checkpoint: into model.safetensors, or into a shard
    of their own named by a model.safetensors.index.json (as the released checkpoints ship them)."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous() for n, t in tensors.items()}
    if not own_shard:
        save_file({**checkpoint_tensors(folder), **tensors}, f"{folder}/model.safetensors", metadata={"format": "pt"})
        return
    save_file(tensors, f"{folder}/model-mtp.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(checkpoint_tensors(folder), "model.safetensors"),
                  **dict.fromkeys(tensors, "model-mtp.safetensors")}
    with open(f"{folder}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def decoder_layer_tensors(folder, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s tensors of a checkpoint, renamed to the MTP layer's."""
    prefix = f"model.layers.{index}."
    return {MTP + n.removeprefix(prefix): t for n, t in checkpoint_tensors(folder).items() if n.startswith(prefix)}


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """The tiny DeepSeek-V3 with a random MTP layer: the decoder layer of a 3-layer model of another seed,
    random norms and eh_proj, its own LM head (shared_head.head) and embedding (a perturbed copy of the
    target's). The exact layer below shares the target's LM head (an equal copy) and embedding (none)."""
    target = tmp_path_factory.mktemp("mtp-random")
    model = build_tiny_model(SPEC, target)
    source_folder = tmp_path_factory.mktemp("mtp-source")
    source = build_tiny_model(dataclasses.replace(SPEC, overrides={**SPEC.overrides, "num_hidden_layers": 3}),
                              source_folder, seed=3)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    generator = torch.Generator().manual_seed(4)
    tensors = decoder_layer_tensors(source_folder, 2)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{MTP}{norm}.weight"] = 1 + 0.2 * torch.randn(hidden, generator=generator)
    tensors[f"{MTP}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.2
    tensors[f"{MTP}shared_head.head.weight"] = torch.randn(vocab, hidden, generator=generator) * 0.2
    tensors[f"{MTP}embed_tokens.weight"] = model.model.embed_tokens.weight.detach() + 0.1 * torch.randn(
        vocab, hidden, generator=generator)
    add_mtp_layer(target, tensors)
    return _Model(str(target)), model, source, tensors


def greedy_next_tokens(model) -> torch.Tensor:
    """Each token's greedy successor under a context-free target."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.arange(vocab)[:, None]).logits[:, 0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near tie: pick another seed"
    return logits.argmax(dim=-1)


@pytest.fixture(scope="module")
def exact_mtp(tmp_path_factory):
    """A target whose next token depends on the current token alone (every attention output projection
    zero, layer 0's MLP too, embedding rows of RMS 1), and an MTP layer that recomputes its last step from the
    token's embedding: enorm 1, eh_proj [I | 0] (the hidden state unused), the decoder layer a copy of the
    target's layer 1 (MLA whose output is zero, the MoE), shared_head.norm the final norm, shared_head.head
    the LM head (equal: shared). Every draft is then the target's own greedy token."""
    target = tmp_path_factory.mktemp("mtp-exact")
    model = build_tiny_model(SPEC, target, seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed[0] = torch.randn(embed.shape[1])  # the pad token's row is zero: every logit alike
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(target)
    follow = greedy_next_tokens(model)
    hidden = model.config.hidden_size
    tensors = decoder_layer_tensors(target, 1)
    tensors[f"{MTP}enorm.weight"] = torch.ones(hidden)
    tensors[f"{MTP}hnorm.weight"] = torch.ones(hidden)
    tensors[f"{MTP}eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors[f"{MTP}shared_head.norm.weight"] = model.model.norm.weight.detach().clone()
    tensors[f"{MTP}shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    add_mtp_layer(target, tensors, own_shard=True)
    return _Model(str(target)), follow


def mtp_llm(target: _Model, engine: dict, k: int, method: str = "mtp") -> LLM:
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **engine,
              speculative_config={"method": method, "num_speculative_tokens": k})
    always_draft(llm)
    return llm


@pytest.fixture(scope="module")
def exact_plain(exact_mtp):
    return run(exact_mtp[0], ENGINES["default"])[0]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_mtp_layer_that_recomputes_the_target_has_every_draft_accepted(exact_mtp, exact_plain, engine):
    target, follow = exact_mtp
    llm = mtp_llm(target, ENGINES[engine], k=3, method="deepseek_mtp" if engine == "async" else "mtp")
    proposer = proposer_of(llm)
    names = {n.removeprefix(MTP) for n, _ in proposer.model.named_parameters()}
    assert not {"embed_tokens.weight", "shared_head.head.weight"} & names, "the target's are shared"
    proposals = record_proposals(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, exact_plain)
    num_checked = [0]
    for tokens, drafts, _ in proposals:
        last = tokens[-1]
        expected = [last := int(follow[last]) for _ in range(len(drafts))]
        assert drafts == expected, "a draft is not the target's greedy token"
        num_checked[0] += len(drafts)
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_draft_tokens == num_checked[0] > 50, (stats, num_checked)
    assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


class ReferenceMtp:
    """The MTP module computed directly: transformers' DeepSeek-V3 decoder layer (the source model's layer
    2) over every position at once, a causal mask, the checkpoint's norms, eh_proj and head."""

    def __init__(self, target_model, source_model, tensors: dict[str, torch.Tensor]) -> None:
        self.t = {n.removeprefix(MTP): t for n, t in tensors.items()}
        self.layer = source_model.model.layers[2]
        self.rotary = source_model.model.rotary_emb
        self.eps = target_model.config.rms_norm_eps
        self.embed = self.t["embed_tokens.weight"]

    def layer_outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Positions 0..n-1, token[p + 1] and hidden state each: the normed outputs [n, hidden]."""
        t, n = self.t, len(tokens)
        embeds = self.embed[tokens].clone()
        embeds[0] = 0  # position 0's embedding is zeroed
        x = torch.cat([rms_norm(embeds, t["enorm.weight"], self.eps), rms_norm(hidden, t["hnorm.weight"], self.eps)],
                      dim=-1) @ t["eh_proj.weight"].T
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        return rms_norm(out[0], t["shared_head.norm.weight"], self.eps)

    def drafts(self, last_hidden: torch.Tensor, tokens: list[int], k: int) -> list[int]:
        """k drafts after `tokens`, from the target's normed last hidden states [len(tokens), hidden]."""
        inputs, hidden, drafts = list(tokens[1:]), last_hidden[:-1], []
        for _ in range(k):
            out = self.layer_outputs(inputs, hidden)[-1]
            drafts.append(int((out @ self.t["shared_head.head.weight"].T).argmax()))
            inputs, hidden = inputs + [drafts[-1]], torch.cat([hidden, out[None]])
        return drafts


def test_a_random_mtp_layer_drafts_what_the_module_computes_and_changes_no_token(random_mtp):
    target, model, source, tensors = random_mtp
    engine = ENGINES["no-prefix-caching"]  # every position's MTP KV is written from the target's states
    plain = run(target, engine)[0]
    llm = mtp_llm(target, engine, k=2)
    proposer = proposer_of(llm)
    assert {"embed_tokens.weight", "shared_head.head.weight"} <= {n.removeprefix(MTP) for n, _ in
                                                                  proposer.model.named_parameters()}
    proposals = record_proposals(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, plain)
    reference = ReferenceMtp(model, source, tensors)
    # A forked sample (n=2) starts without the layer's KV at its prompt's last two positions (spec/eagle.py:
    # never observed in its own row), which changes its drafts, not its tokens: those are left out here.
    forked = workload()[0][4]["prompt_token_ids"]
    checked = [(tokens, drafts) for tokens, drafts, _ in proposals if tokens[: len(forked)] != forked]
    assert len(checked) > 40, len(checked)
    with torch.no_grad():
        for tokens, drafts in checked:
            last_hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
            assert reference.drafts(last_hidden, tokens, len(drafts)) == drafts
    stats = llm.engine.last_stats.spec_decoding
    assert len(proposals) == stats.num_drafts > 20, stats


@pytest.mark.parametrize(("layer", "expert_parallel"),
                         [("random_mtp", False), ("random_mtp", True), ("exact_mtp", False)])
def test_an_mtp_layer_drafts_alike_on_two_tensor_parallel_ranks(request, layer, expert_parallel):
    """TP = 2 (gloo): the MTP layer shards as the target's layers do (its latent attention's heads, its experts
    sliced or, with expert parallelism, half of them whole on each rank), its own embedding and LM head by
    vocabulary (the random layer's) or the target's shared (the exact layer's): the same tokens, drafts and
    acceptances as one rank."""
    target = request.getfixturevalue(layer)[0]
    runs = []
    for engine in ({"async_scheduling": True, "device": "cpu", "kv_cache_space": 0.01},
                   {"async_scheduling": True, "device": "cpu", "kv_cache_space": 0.01, "tensor_parallel_size": 2,
                    "enable_expert_parallel": expert_parallel}):
        llm = mtp_llm(target, engine, k=2)
        # The exact layer's embedding and LM head equal the target's: shared, on each rank (its rows compared).
        kept = {n.removeprefix(MTP) for n, _ in proposer_of(llm).model.named_parameters()} & {
            "embed_tokens.weight", "shared_head.head.weight"}
        runs.append(tokens_drafts_and_acceptances(llm))
        assert kept == (set() if layer == "exact_mtp" else {"embed_tokens.weight", "shared_head.head.weight"})
    assert runs[1] == runs[0] and runs[0][1] > 0


def test_mtp_refuses_what_it_cannot_run(tiny_llama, random_mtp, tmp_path):
    from tokenmill.config import EngineConfig

    target = random_mtp[0]
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        mtp_llm(tiny_llama, dict(kv_cache_space=0.01), k=2)
    no_layer = tmp_path / "no-mtp-tensors"
    build_tiny_model(SPEC, no_layer)  # the config names one MTP layer, the checkpoint has none
    with pytest.raises(ValueError, match=r"no tensors of its MTP layer \(model\.layers\.2\.\*\)"):
        mtp_llm(_Model(str(no_layer)), dict(kv_cache_space=0.01), k=2)
    with pytest.raises(ValueError, match="'mtp' does not run pipeline"):
        EngineConfig.from_kwargs(target.path, pipeline_parallel_size=2, speculative_config={
            "method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="leave out 'model'"):
        EngineConfig.from_kwargs(target.path, speculative_config={"method": "mtp", "model": target.path,
                                                                  "num_speculative_tokens": 2})
