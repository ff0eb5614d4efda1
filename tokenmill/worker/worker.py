"""Worker: owns the device, the model, the KV pool tensors and the model runner."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from transformers import PretrainedConfig

from tokenmill.attention.backend import get_attention_backend
from tokenmill.attention.kv_quant import check_kv_cache_dtype, log_kv_scales, resolve_kv_cache_dtype
from tokenmill.config import EngineConfig, check_device
from tokenmill.distributed.parallel_state import (
    experts_within_replica,
    init_distributed,
    init_replica_world,
    set_expert_parallel,
)
from tokenmill.kernels.kv_fp8 import is_fp8
from tokenmill.kv_cache.sizing import GiB, KVCacheShape, KVCacheSpec, make_kv_cache_spec
from tokenmill.layers.attention import Attention
from tokenmill.layers.mla import LatentAttention
from tokenmill.layers.moe import FusedMoE
from tokenmill.layers.moe_all_to_all import ExpertExchange
from tokenmill.layers.rotary import attach_long_prompt_flags, long_rope_pretrained_len
from tokenmill.model.loader import load_model, resolve_dtype
from tokenmill.scheduler.draft_budget import StepCost
from tokenmill.scheduler.output import SchedulerOutput
from tokenmill.spec.draft_model import DraftModelProposer
from tokenmill.spec.eagle import EagleProposer
from tokenmill.spec.eagle3 import Eagle3Proposer
from tokenmill.spec.mtp import load_mtp_head
from tokenmill.spec.proposers import make_proposer
from tokenmill.spec.tree import TokenTree
from tokenmill.structured.compiler import GrammarCompiler
from tokenmill.structured.matchers import GrammarRows
from tokenmill.worker.chain_draft_graph import ChainDraftGraphs
from tokenmill.worker.cpu_threads import choose_cpu_threads
from tokenmill.worker.cuda_graph import CudaGraphRunner
from tokenmill.worker.draft_model import (
    attention_layers,
    kv_bytes_per_block,
    load_draft_model,
    load_eagle3_head,
    load_eagle_head,
)
from tokenmill.worker.kv_pool_warmer import KVPoolWarmer, block_axis, highest_new_block
from tokenmill.worker.mixed_cuda_graph import DEFAULT_MAX_TOKENS, MixedCudaGraphRunner
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.pending_output import PendingOutput, ReadyOutput
from tokenmill.worker.sampler_warmup import compile_sampler_in_background, warm_up_sampler
from tokenmill.worker.tree_cuda_graph import TreeLevelGraphRunner

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 4.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name)
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but no CUDA device is available: pass --device cpu, or "
                         f"leave it at auto")
    return torch.device(name)


def num_local_devices(device: torch.device) -> int | None:
    """Devices of this kind on this node, one per rank (None: the CPU, where any number of ranks fit)."""
    return torch.cuda.device_count() if device.type == "cuda" else None


def check_tree_support(layers: list[Attention]) -> None:
    """Draft trees attend under a mask of buffer indices, which latent attention's kernels lack and which would
    misplace sliding windows (a node's position is not its index): refused at start-up."""
    if any(isinstance(layer, LatentAttention) for layer in layers):
        raise ValueError("speculative_token_tree does not run with latent attention (MLA) yet: draft a chain "
                         "(leave out speculative_token_tree)")
    if any(layer.sliding_window is not None for layer in layers):
        raise ValueError("speculative_token_tree does not run with sliding-window attention yet: draft a chain "
                         "(leave out speculative_token_tree)")


class Worker:
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int, rank: int = 0,
                 distributed_init_method: str | None = None, local_rank: int | None = None) -> None:
        """Global `rank` of tensor_parallel_size x pipeline_parallel_size ranks (parallel_state's layout), joined
        through `distributed_init_method` when there are several; `local_rank` is its GPU's index among those
        this process sees (default: its index among its node's ranks)."""
        self.config = config
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.rank = rank
        parallel = config.parallel_config
        world_size, replicas = parallel.world_size, parallel.replica_world
        self.device = resolve_device(config.device_config.device)
        if self.device.type == "cuda" and (world_size > 1 or replicas is not None):
            if local_rank is None:
                local_rank = rank % parallel.ranks_per_node
            self.device = torch.device("cuda", local_rank)  # one GPU per rank of this host
            torch.cuda.set_device(self.device)
        # Before the model: its layers take their shard's sizes (and experts) from the groups.
        if replicas is not None:  # one world with the other replicas' ranks, which share the experts out
            init_replica_world(replicas.replica, replicas.num_replicas, replicas.init_method, rank,
                               parallel.tensor_parallel_size, parallel.pipeline_parallel_size, self.device)
        elif world_size > 1:
            init_distributed(rank, world_size, distributed_init_method, self.device,
                             tp_size=parallel.tensor_parallel_size)
        # The server's core process(es) and the offline LLM alike; data-parallel replicas share the cores too.
        self.cpu_threads = None
        if self.device.type == "cpu":
            self.cpu_threads = choose_cpu_threads(world_size * config.parallel_config.data_parallel_size)
        self.dtype = resolve_dtype(config.model_config, hf_config, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, self.dtype)
        torch.manual_seed(config.model_config.seed)
        # The sampler's kernels depend only on the vocabulary and dtype: they compile in another process
        # while this one loads the model, profiles memory and captures graphs.
        self._sampler_compile = (compile_sampler_in_background(hf_config.vocab_size, self.dtype, self.device)
                                 if self.device.type == "cuda" else None)
        set_expert_parallel(config.parallel_config.enable_expert_parallel)  # the MoE layers read it when built
        start = time.perf_counter()
        self.model = load_model(config.model_config, hf_config, self.device, self.dtype)
        logger.info("loaded %s (%s) on %s in %.1f s", type(self.model).__name__, self.dtype, self.device,
                    time.perf_counter() - start)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # In the order the forward pass calls them (data-parallel replicas exchange tokens layer by layer).
        self.moe_exchanges = [m for m in self.model.modules() if isinstance(m, FusedMoE) and m.exchange is not None]
        self.attn_backend = get_attention_backend(config.device_config.attention_backend, self.device)
        speculative = config.speculative_config
        tp = config.parallel_config.tensor_parallel_size
        if speculative is not None and speculative.draft_tensor_parallel_size == 1 and tp > 1 and rank == 0:
            logger.info("speculative_config draft_tensor_parallel_size 1: the drafter shards over the target's %d "
                        "ranks, as the target does (the same drafts)", tp)
        self.draft_model = None
        self.draft_attn_layers: list[Attention] = []
        # A drafter's experts (an MTP layer's, a mixture-of-experts draft model's) stay within the replica.
        if speculative is not None and speculative.method == "draft_model":
            with experts_within_replica():
                self.draft_model = load_draft_model(config, hf_config, self.device, self.dtype, max_model_len)
            self.draft_attn_layers = attention_layers(self.draft_model)
        self.eagle_head = None
        if speculative is not None and speculative.method in ("eagle", "eagle3", "mtp"):
            load = {"eagle": load_eagle_head, "eagle3": load_eagle3_head, "mtp": load_mtp_head}[speculative.method]
            with experts_within_replica():
                self.eagle_head = load(config, hf_config, self.model, self.device, self.dtype, max_model_len)
            self.draft_attn_layers = attention_layers(self.eagle_head)
        self.token_tree = None
        if speculative is not None and speculative.speculative_token_tree is not None:
            self.token_tree = TokenTree.from_paths(speculative.speculative_token_tree)
            check_tree_support(self.attn_layers + self.draft_attn_layers)
        check_kv_cache_dtype(self.kv_cache_dtype, self.device, self.attn_backend.name,
                             has_latent_attention=any(isinstance(layer, LatentAttention)
                                                      for layer in self.attn_layers + self.draft_attn_layers))
        if is_fp8(self.kv_cache_dtype):
            log_kv_scales(self.attn_layers)
        # longrope's per-token flags, for the most tokens a forward pass computes (the token budget; a decode
        # graph's batch).
        sched = config.scheduler_config
        attach_long_prompt_flags(self.model, max(sched.max_num_batched_tokens, self.max_verify_tokens), self.device)
        for drafter in (self.draft_model, self.eagle_head):
            if drafter is not None and long_rope_pretrained_len(drafter) is not None:
                raise ValueError(f"speculative method {speculative.method!r} with a LongRoPE model (Phi-3.5, "
                                 "Phi-4-mini) is not supported yet: use the ngram method")
        self.model_runner: ModelRunner | None = None
        self.num_kv_blocks = 0
        self.kv_pool_warmer: KVPoolWarmer | None = None

    def kv_cache_shape(self) -> KVCacheShape:
        return KVCacheShape(
            num_layers=len(self.attn_layers),
            bytes_per_token=sum(layer.kv_cache_bytes_per_token(self.kv_cache_dtype) for layer in self.attn_layers),
            block_size=self.config.cache_config.block_size,
        )

    def determine_kv_cache_spec(self) -> KVCacheSpec:
        cache = self.config.cache_config
        shape = self.kv_cache_shape()
        if cache.num_gpu_blocks_override is not None:
            available = cache.num_gpu_blocks_override * shape.bytes_per_block
        elif cache.kv_cache_space is not None:
            available = int(cache.kv_cache_space * GiB)
        elif self.device.type == "cpu":
            available = int(DEFAULT_CPU_KV_CACHE_GIB * GiB)
        else:
            available = self._profile_available_gpu_memory()
        if self.draft_attn_layers and cache.num_gpu_blocks_override is None:
            # Every block holds the draft model's (or EAGLE head's) KV of its tokens too.
            draft_bytes = kv_bytes_per_block(self.draft_attn_layers, self.kv_cache_dtype, shape.block_size)
            available = available * shape.bytes_per_block // (shape.bytes_per_block + draft_bytes)
        # With the override, it alone sized the pool: memory settings would not change it.
        sized_by = "kv_cache_space / gpu_memory_utilization" if cache.num_gpu_blocks_override is None else \
            "num_gpu_blocks_override"
        spec = make_kv_cache_spec(shape, available, self.max_model_len, sized_by)
        return dataclasses.replace(spec, long_prompt_len=long_rope_pretrained_len(self.model))

    def _profile_available_gpu_memory(self) -> int:
        """Memory left for the KV pool after weights and the peak of a full-budget forward pass."""
        from tokenmill.worker.profiling import profile_peak_memory

        start = time.perf_counter()
        total = torch.cuda.get_device_properties(self.device).total_memory
        peak = profile_peak_memory(self) + self._verification_bytes()
        budget = int(total * self.config.cache_config.gpu_memory_utilization)
        logger.info("memory profile: peak %.2f GiB of %.2f GiB budget (%.1f s)", peak / GiB, budget / GiB,
                    time.perf_counter() - start)
        if budget <= peak:
            raise RuntimeError(
                f"no memory left for the KV cache: the model needs {peak / GiB:.2f} GiB at peak, "
                f"gpu_memory_utilization grants {budget / GiB:.2f} GiB"
            )
        return budget - peak

    @property
    def max_verify_tokens(self) -> int:
        """Most tokens a step verifying drafts may compute: a decode CUDA graph's worth (the largest batch
        graphs are captured for), so that those steps replay graphs too; at least one request's sampled token and
        all its drafts (with max_num_seqs 1 a step of one request and its drafts replays a graph for steps with
        prefills)."""
        return max(self.config.scheduler_config.max_num_seqs, 1 + self.max_drafts_per_request)

    @property
    def max_drafts_per_request(self) -> int:
        """Draft tokens one request verifies in a step at most: its tree's nodes, or its chain's length."""
        speculative = self.config.speculative_config
        if speculative is None:
            return 0
        return speculative.num_speculative_tokens if self.token_tree is None else self.token_tree.num_nodes

    def _verification_bytes(self) -> int:
        """Draft verification's temporaries (spec/rejection.py: about four float32 [positions, vocab]
        tensors), which the profiled step does not make."""
        if self.config.speculative_config is None:
            return 0
        return 4 * self.max_verify_tokens * self.hf_config.vocab_size * 4

    def initialize_cache(self, spec: KVCacheSpec) -> None:
        shape = spec.shape
        self.num_kv_blocks = spec.num_blocks
        for layer in self.attn_layers + self.draft_attn_layers:
            # A draft's KV in a prefix-cache hit may never have been written: zeros, never stale NaNs.
            layer.allocate_kv_cache(spec.num_blocks, shape.block_size, self.kv_cache_dtype, self.device,
                                    zeroed=layer in self.draft_attn_layers)
        if self.device.type == "cpu":
            self._warm_kv_pool(spec.num_blocks, shape.block_size)
        speculative = self.config.speculative_config
        self.model_runner = ModelRunner(
            self.model,
            self.attn_backend,
            self.device,
            block_size=shape.block_size,
            max_num_reqs=self.config.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            vocab_size=self.hf_config.vocab_size,
            proposer=self._make_proposer(shape.block_size),
            max_drafts=0 if speculative is None else speculative.num_speculative_tokens,
            num_batches_in_flight=self.config.parallel_config.num_batches_in_flight,
            tree=self.token_tree,
            logprobs_mode=self.config.model_config.logprobs_mode,
        )
        if self.device.type == "cuda" and not self.config.device_config.enforce_eager:
            if self.config.parallel_config.pipeline_parallel_size > 1:
                # A stage's forward pass sends and receives between stages: kept out of graphs for now.
                logger.info("pipeline parallelism: CUDA graphs are off, every step runs eagerly")
            else:
                self._capture_cuda_graphs(shape.block_size, pool=self._capture_mixed_cuda_graphs(shape.block_size))
        if self.device.type == "cuda":
            warm_up_sampler(self.model_runner.sampler, self.hf_config.vocab_size, self.dtype, self.device,
                            background=self._sampler_compile)
            self._sampler_compile = None

    def _warm_kv_pool(self, num_blocks: int, block_size: int) -> None:
        """Map the CPU pool's pages ahead of the allocator (worker.kv_pool_warmer) instead of in the steps."""
        layers = self.attn_layers + self.draft_attn_layers
        self.kv_pool_warmer = KVPoolWarmer(
            [(layer.kv_cache, block_axis(layer.kv_cache_shape(1, block_size), layer.kv_cache_shape(2, block_size)))
             for layer in layers], num_blocks)

    def _make_proposer(self, block_size: int):
        speculative = self.config.speculative_config
        if speculative is None:
            return None
        if self.draft_model is not None:
            return DraftModelProposer(self.draft_model, self.attn_backend, self.device, block_size,
                                      self.config.scheduler_config.max_num_seqs)
        if self.eagle_head is not None:
            # EAGLE-1 keeps the target's last hidden states; EAGLE-3 its auxiliary states through the head's fc.
            eagle1 = speculative.method in ("eagle", "mtp")  # MTP drafts from the last states as EAGLE-1 does
            proposer = EagleProposer if eagle1 else Eagle3Proposer
            width = self.hf_config.hidden_size if eagle1 else self.eagle_head.fc.out_features
            return proposer(self.eagle_head, self.attn_backend, self.device, block_size,
                            self.config.scheduler_config.max_num_seqs, width, self.max_drafts_per_request, self.dtype,
                            self.token_tree)
        return make_proposer(speculative)

    def _capture_cuda_graphs(self, block_size: int, pool=None) -> None:
        """Decode graphs of the target, then of the drafter if any (and of its draft tree's level passes), all in
        one memory pool (`pool`: the one the graphs for steps with prefills were captured into, if they were)."""
        if not self.attn_backend.supports_cuda_graphs:
            logger.info("attention backend %r cannot be captured: decode runs eagerly", self.attn_backend.name)
            return
        models = [(self.model, self.model_runner)]
        if self.draft_model is not None or self.eagle_head is not None:
            proposer = self.model_runner.speculative.proposer
            models.append((proposer.graph_step, proposer))  # a draft step and its greedy tokens
        for model, owner in models:
            # A drafter's graphs (an EAGLE head's take its hidden-state input in a static buffer of their own)
            # join the target's pool: drafting and the target's forward pass never overlap.
            runner = CudaGraphRunner(model, self.attn_backend, self.device, block_size,
                                     max_blocks_per_req=-(-self.max_model_len // block_size),
                                     max_batch_size=self.config.scheduler_config.max_num_seqs,
                                     extra_inputs=getattr(owner, "graph_extra_inputs", ()))
            runner.capture(pool)
            pool = runner.pool
            owner.cuda_graphs = runner
        if getattr(owner, "tree_steps", None):  # the drafter (the last owner) drafts trees
            self._capture_tree_level_graphs(owner, block_size, pool)
        elif (self.model_runner.speculative is not None and self.model_runner.speculative.drafts_after_verify
              and self.attn_backend.supports_device_positions):
            # An EAGLE chain drafted right after its verification: all its passes in one graph, their positions
            # moved on the device
            chains = ChainDraftGraphs(owner, self.attn_backend, self.device, block_size,
                                      max_blocks_per_req=-(-self.max_model_len // block_size),
                                      max_rows=self.config.scheduler_config.max_num_seqs)
            chains.capture(pool)
            owner.chain_graphs = chains

    def _capture_tree_level_graphs(self, proposer: EagleProposer, block_size: int, pool) -> None:
        """An EAGLE draft tree's level passes (worker.tree_cuda_graph), into the drafters' pool: each level's
        passes of up to max_num_seqs tokens, whose logits are no more than the largest draft step's."""
        if not self.attn_backend.supports_mixed_cuda_graphs:
            logger.info("attention backend %r has no fixed-grid kernels: draft-tree levels run eagerly",
                        self.attn_backend.name)
            return
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        (width, dtype), = proposer.graph_extra_inputs
        runner = TreeLevelGraphRunner(proposer.tree_steps, self.attn_backend, self.device, block_size,
                                      max_blocks_per_req=-(-self.max_model_len // block_size),
                                      max_num_reqs=max_num_seqs, max_tokens=max_num_seqs, hidden_size=width,
                                      dtype=dtype)
        runner.capture(pool)
        proposer.tree_graphs = runner

    def _capture_mixed_cuda_graphs(self, block_size: int):
        """The target's graphs for steps with prefills (worker.mixed_cuda_graph), captured before the decode graphs
        (their largest step needs the most memory); returns their pool (None if none were captured)."""
        sched = self.config.scheduler_config
        max_tokens = self.config.device_config.max_cudagraph_capture_size
        # No step exceeds the token budget: larger graphs would only cost memory and start-up time.
        max_tokens = min(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, sched.max_num_batched_tokens)
        if max_tokens <= 0:
            return None
        if not self.attn_backend.supports_mixed_cuda_graphs:
            logger.info("attention backend %r has no fixed-grid kernels: steps with prefills run eagerly",
                        self.attn_backend.name)
            return None
        if any(isinstance(m, LatentAttention) for m in self.model.modules()):
            # MLA splits a step's requests between its two forms on the host.
            logger.info("latent attention (MLA): steps with prefills run eagerly")
            return None
        runner = MixedCudaGraphRunner(self.model, self.attn_backend, self.device, block_size,
                                      max_blocks_per_req=-(-self.max_model_len // block_size),
                                      max_num_reqs=sched.max_num_seqs, max_tokens=max_tokens,
                                      trees=self.token_tree is not None)
        runner.capture()
        self.model_runner.mixed_cuda_graphs = runner
        return runner.pool

    def enable_structured_outputs(self, compiler: GrammarCompiler) -> None:
        """Grammars for structured outputs, compiled by `compiler` (the engine core's, which also uses it to
        hold requests back until their grammar is ready)."""
        if not self.model_runner.stage.is_last:  # only the last pipeline stage masks logits and samples
            compiler.shutdown()  # this rank's own copy, never used
            return
        self.model_runner.grammar_rows = GrammarRows(compiler, self.hf_config.vocab_size, self.device,
                                                     tree=self.token_tree)

    def measure_step_cost(self) -> StepCost:
        """t(n) of this device's forward pass, for the draft budget; before any request runs."""
        from tokenmill.worker.step_cost import measure_step_cost

        # One-token requests: no more than the runner has rows (max_num_seqs) and the pool has blocks.
        return measure_step_cost(self, min(self.config.scheduler_config.max_num_seqs, self.num_kv_blocks))

    def measure_prefill_cost(self) -> StepCost:
        """t(n) of a step computing one prompt of n tokens, for the token budget from a step time."""
        from tokenmill.worker.step_cost import measure_prefill_cost

        block_size = self.config.cache_config.block_size
        # A prompt and its sampled token within max_model_len, its blocks within the pool.
        return measure_prefill_cost(self, min(self.config.scheduler_config.max_num_batched_tokens,
                                              self.max_model_len - 1, self.num_kv_blocks * block_size))

    def execute_model(self, scheduler_output: SchedulerOutput) -> PendingOutput | ReadyOutput:
        """Queue the step on the device; result() on the return value waits for its output."""
        assert self.model_runner is not None, "initialize_cache() must run first"
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        if self.cpu_threads is not None:
            self.cpu_threads.before_step()
        if self.kv_pool_warmer is not None:
            self.kv_pool_warmer.note_blocks(highest_new_block(scheduler_output))
        return self.model_runner.execute_model(scheduler_output)

    def start_expert_exchanges(self) -> None:
        """Replicas that share out the experts: their start-up passes done, the MoE layers exchange tokens from now,
        in rounds of at most the profiled step's tokens."""
        from tokenmill.worker.profiling import profiled_num_tokens

        ExpertExchange.tokens_per_step = profiled_num_tokens(self)
        ExpertExchange.live = True

    @torch.inference_mode()
    def exchange_experts_without_tokens(self) -> None:
        """A step of the replica lockstep with no tokens of this replica's: every MoE layer's exchange still
        runs, the other replicas' rows through this one's experts."""
        for layer in self.moe_exchanges:
            layer.exchange_without_tokens(self.dtype)

    @torch.inference_mode()
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks in every layer (a forked sample's own copy of its parent's partial block)."""
        src, dst = torch.tensor(copies, dtype=torch.int64).T.to(self.device)
        for layer in self.attn_layers + self.draft_attn_layers:
            layer.copy_kv_blocks(src, dst)
