"""EAGLE-3 speculative decoding through the whole engine (CPU, float32, tiny random Llamas).

Emitted tokens and logprobs equal plain decoding's in every engine mode, with chains and with draft trees; the
target's states the head receives are transformers' `output_hidden_states` at the head's layers; a random head
in the published layout drafts exactly what a direct torch computation of the head drafts (each tree node from
its own path); and a head built so that its first draft is the target's own greedy token has every first draft
accepted.
"""

from __future__ import annotations

import json

import numpy as np
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
from tokenmill import LLM, SamplingParams
from tokenmill.config import parse_token_tree

HIDDEN, VOCAB = 64, 256
TREE = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]
"""A draft tree of depth 3: two branches at the root, two under the first."""


def tiny_llama_config(num_layers: int, **kwargs):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       eos_token_id=255, bos_token_id=1, tie_word_embeddings=False, **kwargs)


def save_head(path, config, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    config.architectures = ["LlamaForCausalLMEagle3"]
    config.save_pretrained(path)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))


def greedy_next_tokens(model) -> torch.Tensor:
    """Each token's greedy successor under a target that ignores context (every o_proj zero)."""
    with torch.no_grad():
        logits = model(torch.arange(VOCAB)[:, None]).logits[:, 0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, "a near tie: pick another seed"
    return logits.argmax(dim=-1)


@pytest.fixture(scope="module")
def exact_target_and_head(tmp_path_factory):
    """A 3-layer target whose next token depends on the current token alone (every attention output
    projection zero, layer 2's MLP too), and an EAGLE-3 head (`model.`-prefixed names, aux layers 0, 1, 2
    named in its config) that recomputes the target's last step from the target's state at the input of
    layer 1: fc passes that block, the midlayer's attention adds nothing, its MLP, norms and LM head are the
    target's. At position p the head thus finds f(token[p]) = token[p + 1] (a draft-vocabulary id), and d2t
    maps each id d to f(d): the draft is f(token[p + 1]), the target's own greedy token, every time."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(tiny_llama_config(3)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    follow = greedy_next_tokens(model)
    target = tmp_path_factory.mktemp("eagle3-exact-target")
    model.save_pretrained(target)
    head = tmp_path_factory.mktemp("eagle3-exact-head")
    source = model.model.layers[1]
    tensors = {f"model.layers.0.{name}": t.clone() for name, t in source.state_dict().items()
               if not name.startswith("input_layernorm.")}
    for proj in ("q_proj", "k_proj", "v_proj"):  # random attention that reads both halves; o_proj is zero
        rows = getattr(source.self_attn, proj).weight.shape[0]
        tensors[f"model.layers.0.self_attn.{proj}.weight"] = torch.randn(rows, 2 * HIDDEN) * 0.2
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(HIDDEN)
    tensors["model.layers.0.hidden_norm.weight"] = torch.ones(HIDDEN)
    tensors["model.fc.weight"] = torch.cat([torch.zeros(HIDDEN, HIDDEN), torch.eye(HIDDEN),
                                            torch.zeros(HIDDEN, HIDDEN)], dim=1)
    tensors["model.norm.weight"] = model.model.norm.weight.detach().clone()
    tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    tensors["d2t"] = follow - torch.arange(VOCAB)
    tensors["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    save_head(head, tiny_llama_config(1, draft_vocab_size=VOCAB, eagle_aux_hidden_state_layer_ids=[0, 1, 2]), tensors)
    return _Model(str(target)), str(head), model


@pytest.fixture(scope="module")
def random_target_and_head(tmp_path_factory):
    """A random 3-layer target (default aux layers: 2, 3 // 2, 3 - 3) and a random EAGLE-3 head in the
    published layout: `midlayer.*` names, a 64-token draft vocabulary with d2t and t2d, safetensors."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(6)
    model = LlamaForCausalLM(tiny_llama_config(3)).eval()
    target = tmp_path_factory.mktemp("eagle3-random-target")
    model.save_pretrained(target)
    head = tmp_path_factory.mktemp("eagle3-random-head")
    config = tiny_llama_config(1, draft_vocab_size=64)
    config.intermediate_size = 96
    layer = LlamaForCausalLM(config).model.layers[0].state_dict()
    tensors = {f"midlayer.{n}": t for n, t in layer.items() if not n.endswith(("q_proj.weight", "k_proj.weight",
                                                                                "v_proj.weight"))}
    for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        tensors[f"midlayer.self_attn.{proj}.weight"] = torch.randn(rows, 2 * HIDDEN) * 0.2
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = 1 + 0.2 * torch.randn(HIDDEN)
    tensors["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN) * 0.1
    tensors["norm.weight"] = 1 + 0.2 * torch.randn(HIDDEN)
    tensors["lm_head.weight"] = torch.randn(64, HIDDEN)
    draft_to_target = torch.randperm(VOCAB)[:64].sort().values
    tensors["d2t"] = draft_to_target - torch.arange(64)
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, draft_to_target, True)
    save_head(head, config, tensors)
    return _Model(str(target)), str(head), model


def eagle3_llm(target: _Model, head: str, engine: dict, k: int, tree: list | None = None) -> LLM:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    if tree is not None:
        spec["speculative_token_tree"] = tree
    llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **engine,
              speculative_config=spec)
    always_draft(llm)
    return llm


def proposer_of(llm: LLM):
    return llm.engine.core.executor.driver_worker.model_runner.speculative.proposer


def record_aux_states(llm: LLM) -> list:
    """(the row's tokens up to p, the target states handed over at p) for every observed position p
    whose token is on the host (drafted positions and the token of a step still in flight are not)."""
    proposer, records = proposer_of(llm), []
    observe = proposer.observe

    def recording_observe(states, rows, query_start_loc, positions, hidden_states, skip=None):
        known = states.num_tokens[rows] - (states.last_step_index[rows] >= 0)
        for i, row in enumerate(rows.tolist()):
            for j in range(int(query_start_loc[i]), int(query_start_loc[i + 1])):
                p = int(positions[j])
                if p < known[i]:
                    records.append((tuple(states.token_ids[row, : p + 1].tolist()), hidden_states[j].clone()))
        return observe(states, rows, query_start_loc, positions, hidden_states, skip=skip)

    proposer.observe = recording_observe
    return records


def check_aux_states(model, layers: list[int], records: list) -> None:
    """Each handed-over state is transformers' hidden_states at those layers, at that position."""
    cache = {}
    with torch.no_grad():
        for tokens, state in records:
            if tokens not in cache:
                hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
                cache[tokens] = torch.cat([hidden[i][0, -1] for i in layers])
            torch.testing.assert_close(state.cpu(), cache[tokens], atol=1e-4, rtol=1e-4)
    assert len(records) > 100, len(records)


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int], int]]:
    """(a row's tokens, the drafts verified after them, its prompt's length) for every row that verifies drafts
    in a step from now on, as the forward pass reads them: those the proposer made on the host and those
    draft_after_verify left on the device alike."""
    runner = llm.engine.core.executor.driver_worker.model_runner
    states, proposals, forward = runner.states, [], runner._forward

    def recording_forward(batch):
        hidden_states = forward(batch)
        ids = runner.speculative._input_ids.cpu().numpy()  # the step's, drafts placed
        counts = 1 + batch.sampled_num_drafts
        starts = np.cumsum(counts) - counts
        # A row's known tokens end with its first input here; a step launched before the last one's tokens reached
        # the host (worker/verify_ahead.py) is laid out further on, by the drafts that last step rejected.
        ahead = runner._ahead
        rejected = np.zeros(len(batch.rows), dtype=np.int64) if ahead is None else \
            runner.speculative._ahead[1].cpu().numpy()
        sampled = {row: i for i, row in enumerate(batch.rows.tolist())}
        verifying = [(row, int(batch.positions[batch.logits_indices[start]]) + 1 - rejected[sampled[row]],
                      ids[batch.logits_indices[start + 1 : start + 1 + d]].tolist())
                     for row, start, d in zip(batch.sampled_rows.tolist(), starts.tolist(),
                                              batch.sampled_num_drafts.tolist()) if d]
        record = lambda: proposals.extend(  # noqa: E731
            (states.token_ids[row, :known].tolist(), drafts, int(states.num_prompt_tokens[row]))
            for row, known, drafts in verifying)
        if ahead is None:  # the known tokens are all on the host: a step with drafts waits for the last one's
            record()
            return hidden_states
        result = ahead.last.result  # the last step's tokens: on the host once the engine has its result

        def recording_result():
            output = result()
            ahead.last.result = result  # once: later calls return the same output
            record()
            return output

        ahead.last.result = recording_result
        return hidden_states

    runner._forward = recording_forward
    return proposals


@pytest.fixture(scope="module")
def exact_plain(exact_target_and_head):
    return run(exact_target_and_head[0], ENGINES["default"])[0]


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_an_eagle3_head_whose_first_draft_is_the_target_token_is_always_accepted(exact_target_and_head,
                                                                                  exact_plain, engine, tree):
    target, head, model = exact_target_and_head
    llm = eagle3_llm(target, head, ENGINES[engine], k=3, tree=tree)
    records = record_aux_states(llm)
    follow = greedy_next_tokens(model)
    proposals = record_proposals(llm)
    proposer, proposed_on_host = proposer_of(llm), [0]
    propose = proposer.propose

    def counting_propose(states, rows, max_drafts):
        drafts = propose(states, rows, max_drafts)
        proposed_on_host[0] += sum(len(d) > 0 for d in drafts)
        return drafts

    proposer.propose = counting_propose
    outputs = llm.generate(*workload(), use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, exact_plain)
    check_aux_states(model, [0, 1, 2], records)
    if tree is None:  # most chains were drafted right after a verification, and read where they were made
        assert proposed_on_host[0] < len(proposals) // 3, (proposed_on_host, len(proposals))
    counts = {"after_output": 0, "at_prompt_end": 0}
    for tokens, drafts, num_prompt_tokens in proposals:
        if len(tokens) > num_prompt_tokens:
            assert drafts[0] == follow[tokens[-1]], "the first draft is not the target's greedy token"
            counts["after_output"] += 1
        else:  # drafted with the prompt's last chunk: its last token is not f(the one before)
            counts["at_prompt_end"] += 1
    stats = llm.engine.last_stats.spec_decoding
    assert stats.num_drafts == counts["after_output"] + counts["at_prompt_end"], (stats, counts)
    assert counts["after_output"] > 10 and counts["at_prompt_end"] <= counts["after_output"] // 4, counts
    assert stats.accepted_per_position[0] >= counts["after_output"], (stats, counts)
    assert stats.num_accepted_tokens < stats.num_draft_tokens, stats  # later drafts: the head's own states
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"
    if engine == "preempting":
        assert llm.engine.last_stats.num_preemptions > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ReferenceHead:
    """The EAGLE-3 head computed directly in torch from its checkpoint: every position's attention over
    all earlier ones, recomputed from scratch."""

    def __init__(self, path: str, target_model) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.t = load_file(f"{path}/model.safetensors")
        self.config = AutoConfig.from_pretrained(path)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.embed = target_model.model.embed_tokens.weight.detach()

    def layer(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Positions 0..n-1, token and hidden state each: the midlayer's pre-norm outputs [n, hidden]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        t, c, eps = self.t, self.config, self.config.rms_norm_eps
        n, heads, kv_heads = len(tokens), c.num_attention_heads, c.num_key_value_heads
        d = c.hidden_size // heads
        x = torch.cat([rms_norm(self.embed[tokens], t["midlayer.input_layernorm.weight"], eps),
                       rms_norm(hidden, t["midlayer.hidden_norm.weight"], eps)], dim=-1)
        q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        cos, sin = self.rotary(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = (z.repeat_interleave(heads // kv_heads, dim=-3) for z in (k[0], v))
        scores = (q[0] @ k.transpose(-1, -2)) / d**0.5 + torch.full((n, n), float("-inf")).triu(1)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d) @ t["midlayer.self_attn.o_proj.weight"].T
        residual = attn + hidden
        x = rms_norm(residual, t["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = x @ t["midlayer.mlp.gate_proj.weight"].T, x @ t["midlayer.mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T + residual

    def target_id(self, hidden: torch.Tensor, rank: int = 0) -> int:
        """The target id of the draft token of that rank (0: the most likely)."""
        logits = rms_norm(hidden, self.t["norm.weight"], self.config.rms_norm_eps) @ self.t["lm_head.weight"].T
        draft = int(logits.topk(rank + 1).indices[rank])
        return draft + int(self.t["d2t"][draft])

    def tree_drafts(self, aux: torch.Tensor, tokens: list[int], paths: list[tuple[int, ...]]) -> list[int]:
        """The tokens of a tree's nodes (`paths`, breadth-first) after `tokens`: each node the head's top token
        of its rank after its parent, the head run over the context and the node's own path only."""
        inputs, hidden = list(tokens[1:]), aux[:-1] @ self.t["fc.weight"].T
        outputs = {(): self.layer(inputs, hidden)[-1]}  # the head's output after each node's path
        drafts = {}
        for path in paths:
            drafts[path] = self.target_id(outputs[path[:-1]], path[-1])
            ancestors = [path[:i] for i in range(1, len(path) + 1)]
            outputs[path] = self.layer(inputs + [drafts[a] for a in ancestors],
                                       torch.cat([hidden] + [outputs[a[:-1]][None] for a in ancestors]))[-1]
        return [drafts[path] for path in paths]

    def drafts(self, aux: torch.Tensor, tokens: list[int], k: int) -> list[int]:
        """k drafts after `tokens`, from the target's aux states [len(tokens), 3 * hidden]."""
        inputs, hidden = list(tokens[1:]), aux[:-1] @ self.t["fc.weight"].T
        drafts = []
        for _ in range(k):
            out = self.layer(inputs, hidden)[-1]
            drafts.append(self.target_id(out))
            inputs, hidden = inputs + [drafts[-1]], torch.cat([hidden, out[None]])
        return drafts


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_a_random_eagle3_head_drafts_what_the_head_computes_and_changes_no_token(random_target_and_head, tree):
    target, head, model = random_target_and_head
    engine = ENGINES["no-prefix-caching"]  # every position's head KV is written from the target's states
    plain = run(target, engine)[0]
    llm = eagle3_llm(target, head, engine, k=2 if tree is None else 3, tree=tree)
    records = record_aux_states(llm)
    proposals = record_proposals(llm)
    outputs = llm.generate(*workload(), use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, plain)
    check_aux_states(model, [2, 1, 0], records)
    reference = ReferenceHead(head, model)
    # NOTE: the forked samples of the n = 2 request draft from head KV that is not always the reference's (their
    # shared prompt blocks; chains of 3 or more drafts show it too): only the acceptance rate depends on it.
    forked = [o.prompt_token_ids for o in outputs if len(o.outputs) > 1]
    with torch.no_grad():
        for tokens, drafts, _ in proposals:
            if tree is not None and any(tokens[: len(p)] == p for p in forked):
                continue
            hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            aux = torch.cat([hidden[i][0] for i in (2, 1, 0)], dim=-1)
            if tree is None:
                assert reference.drafts(aux, tokens, len(drafts)) == drafts
            else:
                nodes = parse_token_tree(TREE)[: len(drafts)]  # breadth-first, as the engine orders them
                assert reference.tree_drafts(aux, tokens, list(nodes)) == drafts
    stats = llm.engine.last_stats.spec_decoding
    assert len(proposals) == stats.num_drafts > 20 and stats.acceptance_rate < 0.3, stats


@pytest.mark.parametrize("head", ["exact_target_and_head", "random_target_and_head"])
@pytest.mark.parametrize("engine", ["async", "chunked-prefill", "preempting"])
def test_steps_launched_before_the_last_ones_tokens_are_on_the_host_change_no_token(request, head, engine):
    """Greedy requests, none of which needs the host's tokens (worker/verify_ahead.py): under async scheduling
    verifying steps launch before the last one's counts reach the host, laid out as if all its drafts stood and
    moved back on the device by the rejected ones; the tokens and logprobs stay plain decoding's."""
    target, head_path, _ = request.getfixturevalue(head)
    engine = {**ENGINES[engine], "async_scheduling": True}
    prompts = workload()[0]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True, logprobs=2 if i == 2 else None)
              for i in range(len(prompts))]
    plain = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", **engine).generate(
        prompts, params, use_tqdm=False)
    llm = eagle3_llm(target, head_path, engine, k=3)
    speculative, launched_ahead = llm.engine.core.executor.driver_worker.model_runner.speculative, [0]
    take_drafts_ahead = speculative.take_drafts_ahead

    def counting_take_drafts_ahead(ahead):
        launched_ahead[0] += 1
        return take_drafts_ahead(ahead)

    speculative.take_drafts_ahead = counting_take_drafts_ahead
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_same_tokens_and_logprobs(outputs, plain)
    stats = llm.engine.last_stats.spec_decoding
    assert launched_ahead[0] > stats.num_drafts // 8, (launched_ahead, stats)
    assert stats.num_accepted_tokens < stats.num_draft_tokens, stats  # rows moved back by 1 .. k drafts
    kv = llm.engine.core.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "blocks leaked"


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_an_eagle3_head_drafts_alike_on_two_tensor_parallel_ranks(exact_target_and_head, tree):
    """TP = 2 (gloo): the target's auxiliary states are whole on every rank (after the layers' all-reduce), the
    head's layer and its draft LM head shard as the target's: the same tokens, drafts and acceptances as one rank
    (with a draft tree, each rank moves its shard of the accepted path's KV)."""
    target, head, _ = exact_target_and_head
    # On the CPU wherever it runs: two ranks of gloo, also on a machine with one GPU
    runs = [tokens_drafts_and_acceptances(
        eagle3_llm(target, head, engine, 2 if tree is None else len(parse_token_tree(tree)[-1]), tree))
        for engine in ({"async_scheduling": True, "device": "cpu"},
                       {"async_scheduling": True, "tensor_parallel_size": 2, "device": "cpu"})]
    assert runs[1] == runs[0] and runs[0][2] > 0


def test_a_speculators_format_head_drafts_as_the_published_layout(random_target_and_head, tmp_path):
    """The same weights as the `speculators` library saves them (config.json with speculators_model_type and the
    layer's settings under transformer_layer_config, `layers.0.*` names, fc with a bias) draft exactly what the
    published layout drafts; the method and the draft length come from that config, as vLLM takes them."""
    from safetensors.torch import load_file, save_file

    target, head, _ = random_target_and_head
    published = json.load(open(f"{head}/config.json"))
    layer = {k: published[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                       "max_position_embeddings", "rms_norm_eps")}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 64,
              "norm_before_residual": False, "target_hidden_size": None, "transformer_layer_config": layer,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 2}],
                                     "verifier": {"name_or_path": target.path, "architectures": ["LlamaForCausalLM"]}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {name.replace("midlayer.", "layers.0."): t for name, t in load_file(f"{head}/model.safetensors").items()}
    tensors["fc.bias"] = torch.zeros(HIDDEN)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    runs = []
    for spec in ({"method": "eagle3", "model": head, "num_speculative_tokens": 2}, {"model": str(tmp_path)}):
        llm = LLM(target.path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
                  speculative_config=spec)
        always_draft(llm)
        proposals = record_proposals(llm)
        runs.append((tokens_drafts_and_acceptances(llm), proposals))
    assert runs[1] == runs[0] and runs[0][0][1] > 0


def test_eagle3_refuses_what_it_cannot_run(tiny_llama, exact_target_and_head, random_target_and_head, tmp_path):
    from tokenmill.config import EngineConfig

    target, eagle3_head, _ = exact_target_and_head

    def start(target_path: str, method: str, head: str) -> None:
        LLM(target_path, skip_tokenizer_init=True, max_model_len=128, dtype="float32", kv_cache_space=0.01,
            speculative_config={"method": method, "model": head, "num_speculative_tokens": 2})

    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        start(target.path, "eagle3", tiny_llama.path)  # a whole Llama
    with pytest.raises(ValueError, match="use the speculative method 'eagle3'"):
        start(target.path, "eagle", eagle3_head)
    # Default aux layers (2, 1, -1) of a 2-layer target: no such layer.
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        start(tiny_llama.path, "eagle3", random_target_and_head[1])
    config = {**json.load(open(f"{eagle3_head}/config.json")), "num_hidden_layers": 2}  # a head of two layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="one decoder layer"):
        start(target.path, "eagle3", str(tmp_path))
    with pytest.raises(ValueError, match="needs a 'model'"):
        EngineConfig.from_kwargs(target.path, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
