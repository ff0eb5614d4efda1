"""A C kernel for paged attention on the CPU: reads each request's keys and values in place, through its
block table, so a step never gathers or copies the context (the torch path copies it every layer).

One kernel covers every request shape the backend sees: a decode (one query), a prefill chunk, or
several new tokens after a cached context (speculative verification), each query causal at its own
position; plus sliding windows, logit soft-capping and draft trees' masks (a query sees a tree node only where
its ancestor bits name it). A token's keys go by tiles of 16, each key row
read once for all the query heads of its kv head (GQA), into a per-thread scratch row of scores, then a
max-subtracted softmax, then the values by tiles: float32 arithmetic, bfloat16 only as storage (with
AVX512_BF16, bfloat16 queries and keys are multiplied as they are, the exact products added in float32).
With AVX-512 (and a head size of whole 16-lane vectors) a tile's 16 scores are summed across lanes
together; elsewhere (AVX2, ARM, other head sizes) plain loops that the compiler vectorizes do the same
work. Decode is bound by reading the context from memory: the tiles ahead are prefetched, since a
request's blocks lie anywhere in the pool.

The source is compiled on first use with the system C compiler (`cc -O3 -march=native -fopenmp`) into
the tokenmill cache folder, keyed by a hash of the source, flags and CPU, and loaded with ctypes. Its
OpenMP calls land in the libgomp torch already loaded, so the kernel shares torch's thread pool.
`load_kernel()` is None where no compiler works: the backend then falls back to the torch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tokenmill.attention.cpu_kernel_source import SOURCE
from tokenmill.cpu_compile import FLAGS, compile_or_none

_FLAGS = FLAGS

_MAX_HEADS, _MAX_HEAD_DIM = 64, 512  # the kernel's stack rows (MAX_HEADS, MAX_HEAD_DIM)
_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_kernel(flags: tuple[str, ...] = tuple(_FLAGS)) -> ctypes.CDLL | None:
    """The kernel library, built with `flags` (other flags than the default: the tests' builds without
    AVX-512), or None where no compiler works."""
    lib = compile_or_none("paged_attention", SOURCE, "CPU attention: the C kernel", "using the slower torch path",
                          list(flags))
    if lib is None:
        return None
    lib.rope_and_cache.restype = None
    lib.rope_and_cache.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 8 + [ctypes.c_int, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8
                                    + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                    + [ctypes.c_void_p] * 2)
    lib.rope_cache_attention.restype = ctypes.c_int
    lib.rope_cache_attention.argtypes = ([ctypes.c_void_p] * 12 + [ctypes.c_int64] * 12
                                         + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
                                         + [ctypes.c_void_p] * 2)
    lib.kernel_paths.restype = ctypes.c_int
    lib.kernel_paths.argtypes = []
    return lib


# (data pointer, shape, strides, dtype) of a pool -> its K and V halves' data pointers, or None where a half is
# not contiguous. Decided once per pool: at batch 1 the two views per check and per call cost more than the
# attention itself. The answer depends on the key alone, so a new pool (or a view of one) decides afresh.
_POOL_POINTERS: dict[tuple, tuple[int, int] | None] = {}


def pool_pointers(kv_cache: torch.Tensor) -> tuple[int, int] | None:
    """The data pointers of K (kv_cache[0]) and V (kv_cache[1]) where both are contiguous, else None."""
    key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
    try:
        return _POOL_POINTERS[key]
    except KeyError:
        k, v = kv_cache[0], kv_cache[1]
        pointers = (k.data_ptr(), v.data_ptr()) if k.is_contiguous() and v.is_contiguous() else None
        if len(_POOL_POINTERS) >= 1024:  # pools built per call (MLA's expanded requests) must not pile up
            _POOL_POINTERS.clear()
        _POOL_POINTERS[key] = pointers
        return pointers


def tree_pointers(tree_lens: torch.Tensor | None, tree_bits: torch.Tensor | None) -> tuple[int | None, int | None]:
    """The kernel's draft-tree arguments: the data pointers of contiguous int64 tree_lens and tree_bits, or NULLs
    for a step without trees."""
    if tree_lens is None:
        return None, None
    assert tree_lens.dtype == tree_bits.dtype == torch.int64 and tree_lens.is_contiguous() and tree_bits.is_contiguous()
    return tree_lens.data_ptr(), tree_bits.data_ptr()


def heads_fit(num_heads: int, head_dim: int) -> bool:
    """Whether the kernel's stack rows hold a token's heads."""
    return num_heads <= _MAX_HEADS and head_dim <= _MAX_HEAD_DIM


def kernel_applies(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C kernel can run this layer: CPU tensors of one supported dtype, rows of whole heads."""
    return (query.is_cpu and kv_cache.dtype == query.dtype and query.dtype in _DTYPES
            and query.stride(2) == 1 and query.stride(1) == query.shape[2]
            and query.shape[1] % kv_cache.shape[3] == 0 and heads_fit(query.shape[1], query.shape[2])
            and load_kernel() is not None and pool_pointers(kv_cache) is not None)  # K and V go by pointer


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tree_lens: torch.Tensor | None = None,  # [num_reqs] int64: draft-tree nodes ending each request's keys
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64: the nodes each query sees (spec.tree)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every request's new tokens over its cached context; call kernel_applies() first."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=query.dtype)
    block_table = block_table.contiguous()
    k_pointer, v_pointer = pool_pointers(kv_cache)
    status = load_kernel().paged_attention(
        out.data_ptr(), query.data_ptr(), k_pointer, v_pointer, block_table.data_ptr(), query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, block_table.stride(0),
        query.stride(0), out.stride(0), scale, sliding_window or 0, logits_soft_cap or 0.0,
        query.dtype == torch.bfloat16, torch.get_num_threads(), *tree_pointers(tree_lens, tree_bits),
    )
    assert status == 0, "kernel_applies() admits only shapes within the kernel's limits"
    return out


def rope_and_cache_applies(layer, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           max_seq_len: int) -> bool:
    """Whether rope_and_cache() can stand in for the layer's transform_qk and the KV write: a rotary
    embedding whose table covers every position, no per-head q/k norms, key and value rows of whole
    heads (the query: kernel_applies)."""
    return (max_seq_len <= rope_table_length(layer) and positions.dtype == torch.int64
            and key.dtype == value.dtype == layer.kv_cache.dtype
            and key.stride(2) == 1 and key.stride(1) == key.shape[2]
            and value.stride(2) == 1 and value.stride(1) == value.shape[2])


def rope_table_length(layer) -> int:
    """The rows of the layer's rotary table where its rotary embedding and norms admit rope_and_cache, else -1.
    Fixed once the model is built, so decided once per table (a cast of the model builds a new one)."""
    rotary = layer.rotary_emb
    table = None if rotary is None else rotary.cos_sin_cache
    decided = layer.__dict__.get("_rope_and_cache_table")  # (table, rows)
    if decided is None or decided[0] is not table:
        admits = (rotary is not None and layer.q_norm is None and layer.k_norm is None
                  and table.dtype == torch.float32 and rotary.rotary_dim % 2 == 0
                  and rotary.pretrained_len is None)  # the C kernel reads a token's row at its position
        decided = (table, table.shape[0] if admits else -1)
        layer.__dict__["_rope_and_cache_table"] = decided
    return decided[1]


def rope_and_cache(
    layer,
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], the rotated query
    """The layer's rotary embedding applied to query and key, key and value stored at their slots."""
    num_tokens, num_heads, head_dim = query.shape
    rotary = layer.rotary_emb
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    k_pointer, v_pointer = pool_pointers(kv_cache)
    load_kernel().rope_and_cache(
        q_out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), positions.data_ptr(),
        rotary.cos_sin_cache.data_ptr(), slot_mapping.data_ptr(), k_pointer, v_pointer,
        num_tokens, num_heads, key.shape[1], head_dim, rotary.rotary_dim, query.stride(0), key.stride(0),
        value.stride(0), query.dtype == torch.bfloat16, torch.get_num_threads(),
    )
    return q_out


def rope_cache_attention(
    layer,
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    tree_lens: torch.Tensor | None = None,  # as paged_attention_cpu takes them
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """rope_and_cache() then paged_attention_cpu() in one C call (the same arithmetic, so the same output); call
    kernel_applies() and rope_and_cache_applies() first."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    rotary = layer.rotary_emb
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    block_table, positions, slot_mapping = block_table.contiguous(), positions.contiguous(), slot_mapping.contiguous()
    k_pointer, v_pointer = pool_pointers(kv_cache)
    sliding_window, soft_cap = layer.sliding_window, layer.logits_soft_cap
    status = load_kernel().rope_cache_attention(
        out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), positions.data_ptr(),
        rotary.cos_sin_cache.data_ptr(), slot_mapping.data_ptr(), k_pointer, v_pointer, block_table.data_ptr(),
        query_start_loc.data_ptr(), seq_lens.data_ptr(),
        seq_lens.shape[0], num_tokens, num_heads, num_kv_heads, head_dim, rotary.rotary_dim, block_size,
        block_table.stride(0), query.stride(0), key.stride(0), value.stride(0), num_heads * head_dim, layer.scale,
        sliding_window or 0, soft_cap or 0.0, query.dtype == torch.bfloat16, torch.get_num_threads(),
        *tree_pointers(tree_lens, tree_bits),
    )
    assert status == 0, "kernel_applies() admits only shapes within the kernel's limits"
    return out
