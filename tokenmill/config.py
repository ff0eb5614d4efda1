"""Engine configuration: frozen dataclasses, one per concern, built once from user arguments.

Values discovered at run time (number of KV blocks, EOS ids) are never written back here; they
travel as their own objects (`KVCacheSpec`, `TokenizerInfo`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BLOCK_SIZE = 16

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
"""kv_cache_dtype values; fp8 is e4m3 (vLLM's meaning of "fp8"); e5m2 is not implemented; int8 has a scale per
token and KV head."""
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits")
"""What returned logprobs hold (vLLM's logprobs_mode); vLLM's processed_logprobs and processed_logits are refused:
the sampling kernels apply penalties, temperature and top-k/p inside the draw, never writing the processed row."""


def check_device(name: str) -> None:
    """auto, cpu, cuda or cuda:N (one GPU); anything else is a ValueError naming the choices."""
    if name != "auto" and name.partition(":")[0] not in ("cuda", "cpu"):
        raise ValueError(f"device {name!r} is not supported; choose one of auto, cuda, cpu")


def check_model_path(path: str) -> None:
    """FileNotFoundError unless `path` is a model folder or a .gguf file (what the loader reads: no Hub here)."""
    if not (os.path.isdir(path) or (path.endswith(".gguf") and os.path.isfile(path))):
        raise FileNotFoundError(f"model path {path!r} is neither a model folder nor a .gguf file")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    """Path to a Hugging Face model folder or a .gguf file."""
    tokenizer: str | None = None
    """Tokenizer folder; defaults to the model path (or the GGUF file's embedded tokenizer)."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: on the CPU bfloat16 where it has bfloat16 units (AVX512_BF16,
    AMX) else float32 (logged at start-up); on the GPU the checkpoint's 16-bit type."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the model's max_position_embeddings (times a linear or yarn
    RoPE scaling's factor: layers.rotary.max_rope_positions)."""
    load_format: str = "auto"
    """auto (safetensors or GGUF by path) | safetensors | gguf | dummy (random weights)."""
    seed: int = 0
    """Seed for dummy weights and for unseeded sampling."""
    trust_remote_code: bool = False
    """Passed to transformers when reading configs and tokenizers."""
    chat_template: str | None = None
    """Path to a Jinja chat template overriding the model's own."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids and outputs carry no text."""
    quantization: str | None = None
    """Quantize a 16-bit checkpoint at load: fp8 (e4m3 weights with per-channel scales, dynamic per-token
    activation scales). Quantized checkpoints (fp8, compressed-tensors, gptq, awq) are recognised from their
    quantization_config without it, and so are .gguf files (gguf: their linear weights are kept in their GGML
    types on the CPU; on the GPU only when named, Q4_0/Q4_1/Q8_0/Q4_K in 4 or 8 bits for the integer kernels)."""
    gguf_dequantize: bool = False
    """GGUF files: dequantize every tensor to the model's dtype at load (the dense path) instead of keeping the
    linear layers' Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights quantized and multiplying them in place (the CPU
    default; in bfloat16 a small model keeps a dense copy beside them for steps of many rows, a larger one is
    dequantized). The GPU dequantizes at load unless quantization is gguf."""
    hf_overrides: dict[str, Any] | None = None
    """Keys set on the model's Hugging Face config before anything reads it (vLLM's hf_overrides), e.g.
    {"max_position_embeddings": 4096} or {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 32768}}; a dict onto a nested config (text_config) updates its keys.
    The frontend, the engine core and every worker apply it alike; a draft model keeps its own config."""
    max_logprobs: int = 20
    """Most logprobs (and prompt_logprobs) a request may ask for, as vLLM's: more is refused (ValueError offline, a
    400 naming the field on the server); -1: the vocabulary size."""
    logprobs_mode: str = "raw_logprobs"
    """What sampled tokens' logprobs hold: raw_logprobs (log_softmax of the model's logits, before logit_bias,
    penalties, temperature and top-k/p: what the model thinks, whatever the sampling did) | raw_logits (the model's
    logits themselves). vLLM's processed_logprobs / processed_logits (after that processing) are not supported.
    Prompt logprobs are always log_softmax, as vLLM's."""

    def __post_init__(self) -> None:
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config keys, got {type(self.hf_overrides).__name__} "
                             f"(a function of the config is not supported)")
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the vocabulary size) or a non-negative integer, got "
                             f"{self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            processed = self.logprobs_mode in ("processed_logprobs", "processed_logits")
            raise ValueError(f"logprobs_mode {self.logprobs_mode!r} is not supported"
                             + (" (the sampling kernels never write the processed logits)" if processed else "")
                             + f"; choose one of {', '.join(LOGPROBS_MODES)}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV-cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + activations + KV pool)."""
    kv_cache_space: float | None = None
    """KV pool size in GiB; the only sizing input on CPU (default 4 GiB), an override on GPU."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks; for tests that need a tiny pool."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """auto (the model's dtype) | fp8 | fp8_e4m3: the KV pool in float8_e4m3fn (1 byte per element, twice the
    tokens of bfloat16), K and V scaled by the checkpoint's per-layer k_scale / v_scale (1.0 without them) | int8:
    the KV pool in int8 with a float32 scale per token and KV head of K and of V (absmax / 127, computed as each
    token is written: no calibration), about 1.9x the tokens of bfloat16 at head_dim 128. Not for latent (MLA)
    caches."""

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one forward pass (decodes + prefill chunks). None: 8,192 on a GPU; on the CPU 512 with
    chunked prefill (a step's activations then stay in the caches: 64 prompts of 128 tokens prefill ~14% faster
    than in one 8,192-token step), else 8,192."""
    policy: str = "fcfs"
    """fcfs | priority (lower `priority` value runs first, as in vLLM)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request computes in a step (after its prefix-cache hit), as in vLLM: a longer prompt
    is prefilled in chunks of this size, leaving the rest of the budget to other prompts, so that a short one is
    not stuck behind a long one's big chunks. Needs chunked prefill. 0: a chunk is bounded only by the budget."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while the device runs step N (None: on for CUDA, off for the CPU, where the
    same cores would do both)."""
    target_step_ms: float | None = None
    """On a GPU, in place of max_num_batched_tokens: the token budget becomes the prompt tokens this GPU computes
    in about this many milliseconds of one step (measured at start-up; 512 to 8,192), so that a step carrying a
    prompt chunk holds back the requests decoding beside it by about that much. `tokenmill serve` sets 20 unless
    --max-num-batched-tokens is given. None: the fixed budget."""


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """auto | cuda | cpu."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    max_cudagraph_capture_size: int | None = None
    """Largest step with prefills, in tokens, that replays a CUDA graph (prompt chunks beside decodes, short
    prompts, draft verification); larger ones run eagerly, decode-only steps always replay theirs. None:
    min(2048, max_num_batched_tokens); 0: graphs for decode-only steps alone."""
    attention_backend: str | None = None
    """Attention implementation; None picks the platform default."""


EXECUTOR_BACKENDS = ("uni", "mp", "ray")
"""How the ranks run: uni (one rank, in the engine core's process) | mp (a process per rank on this host, or
per rank of this node with --nnodes) | ray (a Ray actor per rank, placed by Ray on the cluster's nodes)."""


@dataclass(frozen=True)
class ReplicaWorld:
    """Where the ranks of data-parallel replicas that share out a model's experts meet (the server sets it in
    each replica's config; engine.replica_lockstep): replica `replica` of `num_replicas`, its rank r being global
    rank replica * tensor_parallel_size + r of one torch.distributed world."""
    replica: int
    num_replicas: int
    init_method: str
    """torch.distributed's init_method: a file in the server's private folder, or a TCP store on the server's node
    when the replicas' ranks are Ray actors."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over devices, with vLLM's argument names."""

    tensor_parallel_size: int = 1
    """Ranks each layer's heads and features are split over (all-reduce after row-parallel layers)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages: each holds a contiguous range of the decoder layers (the first also the embedding, the
    last the final norm and LM head), tensor_parallel_size ranks each."""
    pipeline_batches_in_flight: int | None = None
    """Micro-batches in flight through the pipeline stages, so that every stage computes one while the next
    computes the one before; a request sits out the batches launched while its next token is computed (None:
    pipeline_parallel_size; 1: one batch at a time, the stages taking turns)."""
    distributed_executor_backend: str | None = None
    """uni | mp | ray (None: uni for one rank; for several, mp when they fit this node or nnodes > 1, ray when
    they do not and a Ray cluster is running; chosen when the engine starts)."""
    data_parallel_size: int = 1
    """Engine-core replicas behind one server, each a process of its own with a full copy of the model (and
    its own tensor_parallel_size GPUs: replica r takes GPUs r*tp to (r+1)*tp-1); each request goes to one,
    chosen by load and by the prompt prefix it likely holds in its cache. The server only (`serve`)."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts layers: each tensor-parallel rank holds whole routed experts (1/tp of them) instead
    of a 1/tp slice of every expert; attention and shared experts stay tensor-parallel. With data_parallel_size
    > 1 every rank of a pipeline stage in every replica holds 1/(dp x tp) of that stage's experts instead: each
    MoE layer sends a replica's tokens to their experts' ranks and back (all-to-all), the engine cores stepping
    together (no CUDA graphs; a failed replica stops them all, and they restart together)."""
    nnodes: int = 1
    """Nodes the ranks span over a torch.distributed rendezvous (no Ray): each runs world_size / nnodes ranks;
    node 0 also runs the engine and the server, the others only their ranks (`serve --node-rank N`)."""
    node_rank: int = 0
    """This node's index among nnodes; ranks node_rank * world_size / nnodes onwards run here."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, which every node can reach (nnodes > 1)."""
    master_port: int = 29501
    """Node 0's rendezvous port (torch.distributed's store; the other channels' ports are published there)."""
    headless: bool = False
    """Run only this node's ranks, no engine or server: vLLM's flag, implied by node_rank > 0."""
    replica_world: ReplicaWorld | None = None
    """Set by the server when the data-parallel replicas share out the experts (enable_expert_parallel); not a flag."""

    def __post_init__(self) -> None:
        if type(self.enable_expert_parallel) is not bool:
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._check_nodes()
        batches = self.pipeline_batches_in_flight
        if batches is not None and (type(batches) is not int or not 1 <= batches <= self.pipeline_parallel_size):
            raise ValueError(f"pipeline_batches_in_flight must be an integer from 1 to pipeline_parallel_size "
                             f"({self.pipeline_parallel_size}), got {batches!r}")
        backend = self.distributed_executor_backend
        if backend is None:
            if self.world_size == 1 or self.nnodes > 1:
                object.__setattr__(self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp")
        elif backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend {backend!r} is not supported; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        elif backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank; {self.world_size} need 'mp'")
        elif backend == "ray" and self.nnodes > 1:
            raise ValueError("distributed_executor_backend 'ray' places the ranks on the Ray cluster's nodes "
                             "itself: leave nnodes at 1")

    def _check_nodes(self) -> None:
        for name in ("nnodes", "master_port"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if type(self.node_rank) is not int or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be an integer from 0 to nnodes - 1 ({self.nnodes - 1}), "
                             f"got {self.node_rank!r}")
        if self.master_port > 65535:
            raise ValueError(f"master_port must be at most 65535, got {self.master_port}")
        if type(self.headless) is not bool:
            raise ValueError(f"headless must be a bool, got {self.headless!r}")
        if self.headless and self.node_rank == 0:
            raise ValueError("node 0 runs the engine: headless needs node_rank > 0")
        if self.nnodes > 1:
            if (self.tensor_parallel_size * self.pipeline_parallel_size) % self.nnodes:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({self.world_size}) must be a "
                                 f"multiple of nnodes ({self.nnodes}): every node runs as many ranks")
            if self.data_parallel_size > 1:
                raise ValueError("nnodes > 1 spreads one engine's ranks over the nodes; data_parallel_size > 1 "
                                 "is not supported with it")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def is_headless(self) -> bool:
        """This node runs only its ranks: the engine runs on node 0."""
        return self.node_rank > 0

    @property
    def num_batches_in_flight(self) -> int:
        return self.pipeline_batches_in_flight or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (of each data-parallel replica)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "gguf")
"""What --quantization may name; layers/quant maps each to its config (checkpoints name theirs)."""

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "deepseek_mtp")
"""Proposers a user can name; spec/proposers.py maps each to its class."""

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
"""The `architectures` of EAGLE-3 Llama heads' config.json (the published checkpoints, SGLang's name)."""


def _draft_config_json(model: str) -> dict:
    """The draft folder's config.json; {} for a .gguf file or a folder without a readable one."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def infer_speculative_method(model: str) -> str:
    """The method of a speculative_config that names a `model` but no method, as vLLM infers it: an EAGLE-3 head
    by its config.json's architectures or speculators_model_type (the `speculators` library's format) or an
    "eagle3" in its name, an EAGLE-1 head by an "eagle-" in its name (yuhuili/EAGLE-LLaMA3-Instruct-8B), else a
    draft model."""
    name = os.path.basename(os.path.normpath(model)).lower()
    raw = _draft_config_json(model)
    architectures = raw.get("architectures") or ()
    if (set(architectures) & set(EAGLE3_ARCHITECTURES) or raw.get("speculators_model_type") == "eagle3"
            or "eagle3" in name):
        return "eagle3"
    return "eagle" if "eagle-" in name else "draft_model"


def speculators_num_tokens(model: str) -> int | None:
    """The draft length a `speculators` head's config proposes (its first proposal method's speculative_tokens),
    which vLLM takes where the speculative_config gives none; None for other folders."""
    raw = _draft_config_json(model)
    spec = raw.get("speculators_config") if "speculators_model_type" in raw else None
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        return None
    return methods[0].get("speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `speculative_config` keys: a proposer drafts up to
    `num_speculative_tokens` tokens per request per step and one forward pass verifies them."""

    method: str
    """ngram: prompt lookup over the request's own prompt and output; draft_model: a smaller model with the
    target's vocabulary (`model`) drafts greedily; eagle: an EAGLE-1 head (`model`) drafts greedily from the
    target's last hidden states; eagle3: an EAGLE-3 head (`model`) drafts greedily from the target's hidden
    states at three of its layers; mtp (or vLLM's name deepseek_mtp): the target checkpoint's own
    multi-token-prediction layer (DeepSeek-V3) drafts greedily from its last hidden states."""
    num_speculative_tokens: int
    """Most draft tokens per request per step (k); each step emits 1 to k + 1 tokens per request."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix to look up (default: prompt_lookup_max, or 5)."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix to look up, tried first (default: prompt_lookup_min, or 5)."""
    model: str | None = None
    """draft_model: the draft model's Hugging Face folder or .gguf file (loaded with the target's dtype and
    load_format); eagle, eagle3: the EAGLE head's folder (config.json, safetensors or pytorch_model.bin)."""
    disable_by_batch_size: int | None = None
    """Draft nothing in steps with more running requests than this (None: the step-cost policy decides)."""
    draft_tensor_parallel_size: int | None = None
    """vLLM's placement of the drafter: 1 or the target's tensor_parallel_size, as vLLM takes. The drafter (a draft
    model, an EAGLE head, the MTP layer) always shards over the target's ranks as the target does: 1 only names
    another placement of the same drafts."""
    speculative_token_tree: Any = None
    """eagle, eagle3: draft a tree rather than a chain, verified in one pass under a tree attention mask. A list
    of paths from the root (tuples or lists, or vLLM's string of them), each a node: index i at a level is the
    head's i-th most likely token after the node above, e.g. [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]. Every
    prefix of a path is a node too, and a node's children are 0..b-1. num_speculative_tokens is the tree's
    depth (or its number of nodes). Stored breadth-first, as sorted tuples; None: a chain. The spec_decode
    metrics count a verified tree's depth as its draft tokens, so that acceptance is per depth."""

    def __post_init__(self) -> None:
        # Values from JSON or Python alike: a string for a number is named here, not a TypeError further on.
        for name, kind in (("method", str), ("model", str), ("num_speculative_tokens", int),
                           ("prompt_lookup_min", int), ("prompt_lookup_max", int), ("disable_by_batch_size", int),
                           ("draft_tensor_parallel_size", int)):
            value = getattr(self, name)
            if value is not None and type(value) is not kind:
                what = "an integer" if kind is int else "a string"
                raise ValueError(f"{name} must be {what}, got {json.dumps(value, default=repr)}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if self.method == "deepseek_mtp":
            object.__setattr__(self, "method", "mtp")
        limit = 32 if self.speculative_token_tree is None else MAX_TREE_NODES  # a tree's node count may be given
        if not 1 <= self.num_speculative_tokens <= limit:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {limit}], got "
                             f"{self.num_speculative_tokens!r}")
        if self.method == "mtp" and self.model is not None:
            raise ValueError("speculative method 'mtp' drafts with the target checkpoint's own MTP layers: "
                             "leave out 'model'")
        if (self.method in ("draft_model", "eagle", "eagle3")) != (self.model is not None):
            raise ValueError(f"speculative method {self.method!r} needs a 'model' (the draft model's or EAGLE "
                             f"head's path)" if self.model is None else
                             "only speculative methods 'draft_model', 'eagle' and 'eagle3' take a 'model'")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if 0 in (low, high):  # not "unset": a zero-length lookup is no lookup
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
        low, high = (low or high or 5), (high or low or 5)
        if not 1 <= low <= high:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be positive, got {self.disable_by_batch_size}")
        if self.speculative_token_tree is not None:
            if self.method not in ("eagle", "eagle3"):
                raise ValueError(f"speculative_token_tree needs the speculative method 'eagle' or 'eagle3', not "
                                 f"{self.method!r}")
            tree = parse_token_tree(self.speculative_token_tree)
            depth = len(tree[-1])
            if self.num_speculative_tokens not in (depth, len(tree)):
                raise ValueError(f"num_speculative_tokens ({self.num_speculative_tokens}) must be the "
                                 f"speculative_token_tree's depth ({depth}) or its number of nodes ({len(tree)})")
            object.__setattr__(self, "speculative_token_tree", tree)
            object.__setattr__(self, "num_speculative_tokens", depth)

    @property
    def drafts_after_verify(self) -> bool:
        """Whether the proposer drafts the next step's chain inside the verifying step, right after its rejection
        sampler (spec/eagle.py: heads that draft from the target's states); its draft positions then run up to
        num_speculative_tokens - 1 past the verified ones, which the scheduler allocates with them."""
        return self.method in ("eagle", "eagle3", "mtp") and self.speculative_token_tree is None

    @property
    def tree_level_sizes(self) -> tuple[int, ...] | None:
        """Nodes at each depth 1, 2, ... of the draft tree; None for a chain."""
        tree = self.speculative_token_tree
        if tree is None:
            return None
        return tuple(sum(len(path) == d for path in tree) for d in range(1, len(tree[-1]) + 1))

    @classmethod
    def from_dict(cls, value: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if value.get("method") is None and isinstance(value.get("model"), str):  # vLLM's spelling for a draft model
            value = {**value, "method": infer_speculative_method(value["model"])}
        if "num_speculative_tokens" not in value and isinstance(value.get("model"), str):
            proposed = speculators_num_tokens(value["model"])
            if proposed is not None:
                value = {**value, "num_speculative_tokens": proposed}
        if value.get("method") is None or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' (or a 'model') and 'num_speculative_tokens'")
        return cls(**value)


MAX_TREE_NODES = 63
"""Nodes of a draft tree at most: each verified token's ancestors are one int64 bitmask in the attention kernels."""


def parse_token_tree(value: Any) -> tuple[tuple[int, ...], ...]:
    """speculative_token_tree as its breadth-first sorted paths, checked to form a tree of top-b children."""
    if isinstance(value, str):
        import ast  # only here: most configs have no tree

        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"speculative_token_tree is not a list of paths: {value!r}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"speculative_token_tree must be a non-empty list of paths, e.g. [(0,), (1,), (0, 0)]; "
                         f"got {value!r}")
    paths = []
    for path in value:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(type(i) is int and i >= 0 for i in path)):
            raise ValueError(f"speculative_token_tree: each path is a non-empty tuple of child indices >= 0, "
                             f"got {path!r}")
        paths.append(tuple(path))
    nodes = set(paths)
    if len(nodes) != len(paths):
        raise ValueError("speculative_token_tree: a path is listed twice")
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"speculative_token_tree has {len(paths)} nodes; at most {MAX_TREE_NODES} are supported")
    for path in paths:
        if len(path) > 1 and path[:-1] not in nodes:
            raise ValueError(f"speculative_token_tree: path {path} has no parent {path[:-1]} in the tree")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in nodes:
            raise ValueError(f"speculative_token_tree: path {path} without its sibling "
                             f"{path[:-1] + (path[-1] - 1,)} (a node's children are its top 0..b-1 tokens)")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


GPU_TOKEN_BUDGET = 8192
CPU_TOKEN_BUDGET = 512


def default_token_budget(device: str, chunked_prefill: bool) -> int:
    """SchedulerConfig.max_num_batched_tokens when not given, for the device the engine will run on."""
    if device == "auto":
        import torch  # only here: the config module stays light for the code that only reads it

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return CPU_TOKEN_BUDGET if device == "cpu" and chunked_prefill else GPU_TOKEN_BUDGET


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


_REASONING_KEYS = {
    "reasoning_parser": ("", "tokenmill's reasoning parser is the server's: `tokenmill serve --reasoning-parser NAME` "
                             "(offline, StructuredOutputsParams(reasoning_end=\"</think>\") starts the structure "
                             "after the reasoning)"),
    "reasoning_parser_plugin": ("", "a reasoning parser plugin is the server's: `tokenmill serve "
                                    "--reasoning-parser-plugin FILE --reasoning-parser NAME`"),
    "enable_in_reasoning": (False, "with --reasoning-parser the structure applies once the reasoning is over; to "
                                   "constrain from the first token, serve without --reasoning-parser (or with "
                                   "thinking off in the chat template)"),
}
"""vLLM's structured_outputs_config keys of its reasoning parser: accepted at vLLM's defaults, else refused with
what to use instead (tokenmill's reasoning parser is the server's, not the engine's)."""


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs, with vLLM's `structured_outputs_config` keys. A request's own StructuredOutputsParams
    (backend, disable_any_whitespace, disable_additional_properties, disable_fallback) wins over these."""

    backend: str = "auto"
    """Which library enforces a spec: xgrammar; guidance (llguidance) for every spec but structural tags (xgrammar's
    format); auto: xgrammar, and llguidance for a JSON schema that only it enforces whole (minLength/maxLength beside
    a pattern or a format, multipleOf on numbers, ...)."""
    disable_fallback: bool = False
    """Under backend auto, a JSON schema that xgrammar would enforce only in part is refused (400) rather than
    handed to llguidance: every spec is then xgrammar's. No effect with a named backend (which never falls back)."""
    disable_any_whitespace: bool = True
    """JSON (json and json_object specs) written with no whitespace between its tokens: xgrammar writes ", " and
    ": ", llguidance "," and ":". False lets the model put any whitespace there, as vLLM does by default (vLLM's
    default is False; tokenmill's is True: small models otherwise loop on whitespace until max_tokens)."""
    disable_additional_properties: bool = False
    """llguidance: an object whose schema has no additionalProperties (nor unevaluatedProperties) takes only the
    properties it names, as under xgrammar (llguidance otherwise lets the model add any other)."""

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend {self.backend!r} is not supported; choose one of "
                             f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"structured_outputs_config's {f.name} must be true or false, got "
                                 f"{getattr(self, f.name)!r}")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"structured_outputs_config must be a dict, got {type(value).__name__}")
        value = dict(value)
        for key, (default, instead) in _REASONING_KEYS.items():
            if key in value and value.pop(key) != default:
                raise ValueError(f"structured_outputs_config's {key} is not supported: {instead}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown structured_outputs_config keys {unknown}; known: {known}")
        return cls(**value)


@dataclass(frozen=True)
class ReasoningConfig:
    """The markers of a reasoning block, with vLLM's `reasoning_config` keys: what a request's thinking_token_budget
    counts between (and forces the end of). `tokenmill serve --reasoning-parser NAME` sets them from its parser
    unless --reasoning-config does."""

    reasoning_start_str: str = ""
    """The text that opens a reasoning block ("<think>"); empty: none (thinking_token_budget refused)."""
    reasoning_end_str: str = ""
    """The text that closes it ("</think>")."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), str):
                raise ValueError(f"reasoning_config's {f.name} must be a string, got {getattr(self, f.name)!r}")
        if bool(self.reasoning_start_str) != bool(self.reasoning_end_str):
            raise ValueError("reasoning_config needs both reasoning_start_str and reasoning_end_str (or neither)")

    @property
    def has_markers(self) -> bool:
        return bool(self.reasoning_start_str)

    @classmethod
    def of_parser(cls, name: str) -> ReasoningConfig:
        """The markers a reasoning parser writes first (`<think>`, `</think>`); ValueError for an unknown parser."""
        from tokenmill.server.reasoning_parsers import get_reasoning_parser

        parser = get_reasoning_parser(name)
        return cls(parser.starts[0], parser.ends[0])

    @classmethod
    def from_dict(cls, value: dict[str, Any] | ReasoningConfig | None) -> ReasoningConfig:
        if value is None:
            return cls()
        if isinstance(value, ReasoningConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"reasoning_config must be a dict, got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(value) - set(known)):
            raise ValueError(f"unknown reasoning_config keys {unknown}; known: {known}"
                             + (" (the reasoning parser is the server's --reasoning-parser)"
                                if "reasoning_parser" in unknown else ""))
        return cls(**value)


CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's chat_template_content_format: how a message's content reaches the chat template. 'string': one string
(text parts joined with newlines); 'openai': a list of {"type": "text", "text": ...} parts (string content too, none
as no parts); 'auto': openai for a template that loops over a message's content, else string."""


UNSUPPORTED_VLLM_ARGS = {
    "enable_lora": "LoRA adapters",
    "lora_modules": "LoRA adapters",
    "max_loras": "LoRA adapters",
    "max_lora_rank": "LoRA adapters",
    "max_cpu_loras": "LoRA adapters",
    "cpu_offload_gb": "offloading weights to CPU memory",
    "kv_offloading_size": "offloading the KV cache to CPU memory",
    "kv_offloading_backend": "offloading the KV cache to CPU memory",
    "enable_sleep_mode": "sleep mode",
    "limit_mm_per_prompt": "multimodal inputs",
    "mm_processor_kwargs": "multimodal inputs",
    "otlp_traces_endpoint": "OpenTelemetry tracing",
    "kv_transfer_config": "KV-cache transfer between instances (disaggregated prefill)",
    "enable_eplb": "expert-parallel load balancing",
    "enable_dbo": "dual-batch overlap",
}
"""vLLM's engine and server arguments of features tokenmill does not have yet, and the feature each belongs to: the
CLI's flags and LLM's keyword arguments are refused by name, not as unknown (a user moving from vLLM learns what is
missing, not that they misspelled it)."""


def unsupported_vllm_arg(name: str, spelling: str) -> str | None:
    """Why `name` (an argument of UNSUPPORTED_VLLM_ARGS, written as `spelling`) is refused; None for other names."""
    feature = UNSUPPORTED_VLLM_ARGS.get(name)
    if feature is None:
        return None
    return f"{spelling}: tokenmill does not support {feature} yet (vLLM does); leave it out"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    reasoning_config: ReasoningConfig = field(default_factory=ReasoningConfig)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Route vLLM-style flat engine arguments to the sub-config that owns each one (those without a field of
        their own first mapped onto tokenmill's: engine_args.py)."""
        from tokenmill.engine_args import vllm_engine_kwargs

        kwargs = vllm_engine_kwargs(model, kwargs)
        parts: dict[str, dict[str, Any]] = {}
        speculative = SpeculativeConfig.from_dict(kwargs.pop("speculative_config", None))
        structured = StructuredOutputsConfig.from_dict(kwargs.pop("structured_outputs_config", None))
        if (backend := kwargs.pop("guided_decoding_backend", None)) is not None:  # vLLM's older name
            structured = dataclasses.replace(structured, backend=backend)
        reasoning = ReasoningConfig.from_dict(kwargs.pop("reasoning_config", None))
        owners = {
            "model_config": ModelConfig,
            "cache_config": CacheConfig,
            "scheduler_config": SchedulerConfig,
            "device_config": DeviceConfig,
            "parallel_config": ParallelConfig,
        }
        for key, value in kwargs.items():
            for part, klass in owners.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    parts.setdefault(part, {})[key] = value
                    break
            else:
                raise TypeError(unsupported_vllm_arg(key, key) or f"unknown engine argument {key!r}")
        built = {part: klass(**parts.get(part, {})) for part, klass in owners.items() if part != "model_config"}
        return cls(model_config=ModelConfig(model=model, **parts.get("model_config", {})), **built,
                   speculative_config=speculative, structured_outputs_config=structured, reasoning_config=reasoning)

    def with_parts(self, **parts: Any) -> EngineConfig:
        """A copy with some sub-configs replaced (derived from this one's, e.g. a data-parallel replica's place),
        without the checks of a new config's arguments: once resolved, a config holds both a target_step_ms and
        the token budget it caps, which a new one would refuse as given together."""
        derived = copy.copy(self)
        for name, value in parts.items():
            object.__setattr__(derived, name, value)
        return derived

    def __post_init__(self) -> None:
        target = self.scheduler_config.target_step_ms
        if target is not None and (self.scheduler_config.max_num_batched_tokens is not None or target <= 0):
            raise ValueError("target_step_ms must be positive" if target <= 0 else
                             "target_step_ms sets the token budget from the step time: give it or "
                             "max_num_batched_tokens, not both")
        if self.scheduler_config.max_num_batched_tokens is None:
            budget = default_token_budget(self.device_config.device, self.scheduler_config.enable_chunked_prefill)
            object.__setattr__(self, "scheduler_config",
                               dataclasses.replace(self.scheduler_config, max_num_batched_tokens=budget))
        cache, sched = self.cache_config, self.scheduler_config
        if cache.block_size <= 0 or cache.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {cache.block_size}")
        if not 0.0 < cache.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}")
        if sched.max_num_seqs <= 0 or sched.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.model_config.max_model_len is not None and self.model_config.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.model_config.max_model_len}")
        # torch.manual_seed's range: past it, torch fails after the model has loaded, naming no setting.
        if self.model_config.seed is not None and not -2**63 <= self.model_config.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer (below 2**64), got {self.model_config.seed}")
        if cache.kv_cache_space is not None and cache.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be a positive number of GiB, got {cache.kv_cache_space}")
        if cache.num_gpu_blocks_override is not None and cache.num_gpu_blocks_override <= 0:
            raise ValueError(f"num_gpu_blocks_override must be a positive number of blocks, got "
                             f"{cache.num_gpu_blocks_override}")
        if sched.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 (no cap) or a positive number of tokens, got "
                             f"{sched.long_prefill_token_threshold}")
        if sched.long_prefill_token_threshold and not sched.enable_chunked_prefill:
            # Its cap splits prompts into chunks, which is what disabling chunked prefill forbids.
            raise ValueError("long_prefill_token_threshold caps each step's prompt chunk, which needs chunked "
                             "prefill: enable chunked prefill or leave the threshold at 0")
        if sched.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {sched.policy!r}")
        if self.model_config.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.model_config.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.model_config.load_format not in LOAD_FORMATS:
            raise ValueError(f"unsupported load_format {self.model_config.load_format!r}; choose one of "
                             f"{', '.join(LOAD_FORMATS)}")
        check_device(self.device_config.device)  # said before anything loads
        if self.model_config.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"unknown quantization {self.model_config.quantization!r}; choose one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        spec = self.speculative_config
        if (spec is not None and spec.method in ("draft_model", "eagle", "eagle3", "mtp")
                and self.parallel_config.pipeline_parallel_size > 1):
            # The drafter needs the target's embedding and last hidden states, which live on different stages.
            raise ValueError(f"speculative method {spec.method!r} does not run pipeline-parallel yet: use "
                             "pipeline_parallel_size 1, or the ngram method")
        tp = self.parallel_config.tensor_parallel_size
        if spec is not None and spec.draft_tensor_parallel_size not in (None, 1, tp):
            raise ValueError(f"speculative_config draft_tensor_parallel_size must be 1 or the target's "
                             f"tensor_parallel_size ({tp}), got {spec.draft_tensor_parallel_size}")
        if spec is not None and spec.model is not None and not os.path.exists(spec.model):
            # Said now, not once the target has loaded (a draft model or head is a local folder or file).
            raise ValueError(f"speculative_config model {spec.model!r} does not exist: pass the draft model's or "
                             f"EAGLE head's folder")
