"""Integer-weight GEMMs (W4A16, W8A16): y = x @ dequant(W).T with the weight dequantized in registers.

The weight is in layers.quant.w4a16's layout, the one every checkpoint format (GPTQ, AWQ,
compressed-tensors pack-quantized) is repacked into at load: `weight_packed` int32 [n, k / pack] packed
along k (lowest bits first), `weight_scale` [n, groups], `weight_zero` [n, groups] or none (the midpoint
2^(bits-1)), and an optional input permutation (act-order) applied to x as it is loaded. A program reads
its weight tile as int32 words, shifts each feature's bits out, and scales by its group: the weight crosses
memory at 4 (or 8) bits, and no 16-bit copy is kept (the large-row path's is transient, shared by all layers).

Two fused kernels, and a dequantization for larger row counts (int_weight_gemm chooses by the row count):
- `gemv_int`, decode of up to 4 rows: on the CUDA cores, each program owning BLOCK_N output columns (and K, or a
  split of it: kernels.split_k, where the device's swept tiles table says so), every word
  unpacked once for all the rows (one and per weight into a float's bits, no int-to-float conversion, no fma)
  and kept in its packed shape ([units of 1-4 words, groups, words, slots, columns], x loaded to match: no
  change of layout, no shared memory in the loop), the zero point and the scale applied per unit to the sums
  rather than per weight (scale * (sum q * x - zero * sum x)). The skinny kernel's 16-row tensor-core tile at
  one row ran at a tenth of the weights' read rate on the H200 (BENCHMARKS.md): the unpacking, not the memory,
  set the pace.
- `skinny_int_gemm`, decode (<= 16 rows): each program owns BLOCK_N output columns and walks all of K, as
  kernels.skinny_gemm does for 16-bit weights; a decode step only streams weights, and these are a quarter
  of the bytes.
- `dequant_int_gemm`, past the skinny kernel's rows (prefill, larger batches): `dequantize_int_weight`
  writes the 16-bit weight into one scratch buffer per device (kernels.dequant_scratch), and cuBLAS multiplies.
  A pass over the weight whatever the rows, then bf16's speed: the fused kernels unpack each weight once per
  tile of rows, and that unpacking, not the bytes, sets their pace.
When a group spans a whole number of BLOCK_K steps (group sizes 64, 128, per-channel) each step meets one
scale per column; otherwise (group 32 under wider steps) the scales are gathered per feature.
The references are layers.quant.w4a16.dequantize_int / int_linear_torch (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.dequant_scratch import dequant_scratch
from tokenmill.kernels.int4_mma_gemv import gemv_int4_mma, mma_gemv_takes
from tokenmill.kernels.pdl import let_next_launch, pdl_launch, wait_for_previous
from tokenmill.kernels.split_k import finish_split, k_per_split, split_buffers, split_range
from tokenmill.kernels.tile_tables import swept_tiles

SKINNY_MAX_ROWS = 16  # the tensor-core tile's minimum height: up to this many rows cost the same weight read


@triton.jit
def _load_x(x_ptr, perm_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, HAS_PERM: tl.constexpr):
    if HAS_PERM:  # act-order: the weight's feature j is the input's feature perm[j]
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :],
                   mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, n_mask, k_mask, start, k_end, stride_wn, stride_sn,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_ZERO: tl.constexpr):
    """The float32 weight tile [BLOCK_N, BLOCK_K] of features start + offs_k. GROUP 0: per-channel."""
    PACK: tl.constexpr = 32 // BITS
    mask = n_mask[:, None] & k_mask[None, :]
    row = offs_n[:, None].to(tl.int64)
    # Each word once (a contiguous [BLOCK_N, BLOCK_K / PACK] tile, vectorized loads), then its PACK values
    # shifted out along a new last axis and folded back into K: feature k is slot k % PACK of word k // PACK.
    offs_w = start // PACK + tl.arange(0, BLOCK_K // PACK)
    words = tl.load(w_ptr + row * stride_wn + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w * PACK < k_end)[None, :],
                    other=0)
    shifts = tl.arange(0, PACK) * BITS
    # The arithmetic shift of a negative word copies its sign bit in from the top: the mask removes it.
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
    if GROUP == 0 or GROUP % BLOCK_K == 0:  # one group per column in this step
        if GROUP == 0:
            group = 0
        else:
            group = start // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            z = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    else:
        index = row * stride_sn + (offs_k // GROUP)[None, :]
        s = tl.load(s_ptr + index, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + index, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        return (q - z) * s
    return (q - (1 << (BITS - 1))) * s  # symmetric: the midpoint


# The row count changes with the batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=["num_rows"])
def _skinny_int_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, num_rows, n, k, stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < num_rows, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        x = _load_x(x_ptr, perm_ptr, offs_m, offs_k, m_mask, k_mask, stride_xm, HAS_PERM)
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, offs_n, offs_k, n_mask, k_mask, start, k, stride_wn, stride_sn,
                          BITS, GROUP, BLOCK_N, BLOCK_K, HAS_ZERO)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_int_kernel(
    w_ptr, s_ptr, z_ptr, out_ptr, n, k, stride_wn, stride_sn, stride_on,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # The weight tile unpacked in the words' shape, [BLOCK_N, words, PACK slots], then read as [BLOCK_N, BLOCK_K]
    # (feature w * PACK + p is slot p of word w: a free reshape) for the stores: each thread's slots of a word are
    # consecutive features (one 16-byte store of 8 bf16 for int4), a warp's 32 words of a row contiguous. Columns
    # stay in the packed order: with act-order, x[:, perm]'s.
    PACK: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PACK
    TWO_23: tl.constexpr = 0x4B000000  # 2^23's float32 bits
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    n_mask = (offs_n < n)[:, None]
    mask = n_mask & (offs_w < k // PACK)[None, :]
    row = offs_n[:, None].to(tl.int64)
    words = tl.load(w_ptr + row * stride_wn + offs_w[None, :], mask=mask, other=0)
    slots = tl.arange(0, PACK)
    bits = (words.to(tl.uint32, bitcast=True)[:, :, None] >> (slots * BITS)[None, None, :]) & ((1 << BITS) - 1)
    # q's bits in the mantissa of 2^23: the float 2^23 + q, exactly, without an int-to-float conversion.
    q = (bits | TWO_23).to(tl.float32, bitcast=True)
    if GROUP == 0 or GROUP % BLOCK_K == 0:  # one group per row in this tile
        group = 0 if GROUP == 0 else tl.program_id(1) * BLOCK_K // GROUP
        s_offs = row * stride_sn + group
        s_mask = n_mask
    else:  # several: each word's (a group spans whole words)
        s_offs = row * stride_sn + (offs_w * PACK // GROUP)[None, :]
        s_mask = mask
    s = tl.load(s_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)[:, :, None]
    if HAS_ZERO:  # q exactly, then less the zero point: GGUF's are ratios (-m / d), which 2^23 + zero would round
        w = ((q - 8388608.0) - tl.load(z_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)[:, :, None]) * s
    else:
        w = (q - (8388608.0 + (1 << (BITS - 1)))) * s  # symmetric: the midpoint
    w = tl.reshape(w.to(out_ptr.dtype.element_ty), (BLOCK_N, BLOCK_K))
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + row * stride_on + offs_k[None, :], w, mask=n_mask & (offs_k < k)[None, :])


@triton.jit
def _gemv_step_loads(w_ptrs, s_ptr, z_ptr, s_offs, word, offs_g, start, k, valid, WORD_SLOTS: tl.constexpr,
                     SUB: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr):
    """A step's weight words [W, G, H, 1, BLOCK_N] and its scales and zeros [W, G, BLOCK_N] (GROUP 0: none,
    loaded once), each thread loading those of its own words (the same for the W units of a group: cached
    loads), so they need no change of layout either.
    `valid` (scalar) turns the prefetch past the last step off; without EVEN_K the words and groups past k are
    masked off too."""
    if EVEN_K:
        w_mask = valid
        g_mask = valid
    else:
        w_mask = valid & (start // WORD_SLOTS + word < k // WORD_SLOTS)
        g_mask = valid & (start + offs_g * SUB < k)[None, :, None]
    words = tl.load(w_ptrs + start // WORD_SLOTS, mask=w_mask, other=0)
    s = 0.0
    z = 0.0
    if GROUP != 0:
        group = (start + offs_g * SUB) // GROUP
        offs = tl.max_contiguous(s_offs + group[None, :, None], [1, 1, 1])
        s = tl.load(s_ptr + offs, mask=g_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + offs, mask=g_mask, other=0.0).to(tl.float32)
    return words, s, z


@triton.jit
def _gemv_row(acc, f, z, x_ptr, cols, x_mask, s, x_offset, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
              F_OFFSET: tl.constexpr):
    """One row's part of a step: acc [W, G, BLOCK_N] += scale * (sum over each unit's slots of q * x, less
    zero * sum of x), with x [W, G, H, P, 1] in the words' shape; the sums over the units and the groups wait
    for the end. With F_OFFSET, f is c + q per slot: the c * x terms (with the midpoint's for symmetric
    weights: x_offset) come off once per unit, for all the columns; without, f holds q (less the midpoint)."""
    x = tl.load(x_ptr + cols, mask=x_mask, other=0.0).to(tl.float32)
    dots = tl.sum(tl.sum(f * x, axis=3), axis=2)
    if F_OFFSET:
        dots -= tl.sum(tl.sum(x * x_offset, axis=3), axis=2)
    if HAS_ZERO:  # the zero point once per unit and column, not per weight
        dots -= z * tl.sum(tl.sum(x, axis=3), axis=2)
    if GROUP == 0:
        return acc + dots  # per-channel: scaled once at the end
    return acc + dots * s


@triton.jit
def _gemv_store(out_ptr, acc, s_end, offs_n, n_mask, part_ptr, arrival_ptr, split_stride, GROUP: tl.constexpr,
                SPLITS: tl.constexpr):
    """One row's outputs from its accumulator; with SPLITS, this program's part of them (kernels.split_k), part_ptr
    the row's partials of split 0."""
    out = tl.sum(tl.sum(acc, axis=0), axis=0)
    if GROUP == 0:
        out = out * s_end
    if SPLITS == 1:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        finish_split(out, out_ptr + offs_n, part_ptr + offs_n, split_stride, n_mask, arrival_ptr, SPLITS)


@triton.jit(do_not_specialize=["no_bits"])  # its value (0) would let the compiler fold it
def _gemv_int_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, arrivals_ptr, n, k, k_per_split, stride_xm, stride_wn,
    stride_sn, stride_om, no_bits,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, H: tl.constexpr, SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # A row or a few on the CUDA cores, each program owning BLOCK_N output columns and walking all of K (or its
    # split's part of it: kernels.split_k).
    # The words stay in their packed shape from load to sum, [W units, G groups, H words, P slots, BLOCK_N
    # columns] (a unit: H consecutive words, 1, 2 or 4: _gemv_unit): feature ((g * W + w) * H + h) * P + p of
    # the step is slot p of word (g * W + w) * H + h, and x is loaded in that shape, [W, G, H, P, 1]. Both loads
    # then give each thread the same units (consecutive threads on consecutive units: coalesced), the units of
    # all BLOCK_N columns (4- to 16-byte loads) and x's H * P features of each (H 16-byte loads for int4, used
    # for every column), so nothing changes layout in the loop. The old kernel's reshape of the unpacked tile
    # into [BLOCK_N, BLOCK_K] sent 8x the weight's bytes through shared memory every step. Wider units cut the
    # loads, their addresses and the per-unit work (scales, the sums' corrections) per weight.
    P: tl.constexpr = 32 // BITS
    SUB: tl.constexpr = GROUP if GROUP > 0 and GROUP < BLOCK_K else BLOCK_K  # the features one scale covers
    G: tl.constexpr = BLOCK_K // SUB
    W: tl.constexpr = SUB // (P * H)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    rows_n = tl.minimum(offs_n, n - 1)  # the last block's extra columns read the last row: no load masks on n
    offs_g = tl.arange(0, G)
    offs_h = tl.arange(0, H)[None, None, :, None, None]
    offs_p = tl.arange(0, P)
    unit = tl.arange(0, W)[:, None] + offs_g[None, :] * W  # [W, G]
    word = unit[:, :, None, None, None] * H + offs_h  # [W, G, H, 1, 1]
    feature = word * P + offs_p[None, None, None, :, None]  # [W, G, H, P, 1]
    # A unit's H words per thread and column (the layout x's 16-byte loads get, one per word), not 16-byte
    # vectors of 4 words, which would reach x's layout only through shared memory: the hint keeps the words'
    # load in x's layout (threads in the same dimension order).
    w_offs = tl.max_contiguous(word + rows_n[None, None, None, None, :].to(tl.int64) * stride_wn, [1, 1, H, 1, 1])
    w_ptrs = w_ptr + w_offs
    s_offs = tl.zeros([W, 1, 1], tl.int32) + (rows_n * stride_sn)[None, None, :]  # [W, 1, BLOCK_N]
    # Unpacking in one instruction per weight (and 2 shifts per int4 word), no int-to-float conversion (a
    # quarter-rate instruction) and, up to 2 rows, no fma: slot p's bits at bit `pos` of the mantissa under the
    # exponent of 2^(23 - pos) make the float f = 2^(23 - pos) + q, exactly. The dots take f as it is; the
    # c = 2^(23 - pos) terms, x's alone (c * x summed over a unit's slots), come off once per unit for all the
    # columns. Three copies of an int4 word cover its slots, shifted left by 11 bits, not at all, or right by 9
    # (slots 0-2, 3-4, 5-7) to pos 11-19: c <= 2^12, at most 2^9 times q's mean, so each q * x keeps 15 of
    # float32's 24 bits (the weight's bf16 dequantization keeps 8); int8's bytes get a copy each, at pos 12.
    # Each slot is then one and-or (LOP3: the copy, its mask, its exponent): `no_bits`, a zero the compiler
    # cannot see, keeps the exponents in registers (as constants they are or'ed in separately: an instruction
    # per weight more).
    if BITS == 4:
        shift = tl.where(offs_p < 3, 11, tl.where(offs_p < 5, 0, -9))
    else:
        shift = 12 - offs_p * BITS
    pos = offs_p * BITS + shift
    shift_left = tl.maximum(shift, 0).to(tl.uint32)[None, None, None, :, None]
    shift_right = tl.maximum(-shift, 0).to(tl.uint32)[None, None, None, :, None]
    exponent = (150 - pos) << 23
    slot_mask = (((1 << BITS) - 1) << pos).to(tl.uint32)[None, None, None, :, None]
    slot_exponent = (exponent + no_bits).to(tl.uint32)[None, None, None, :, None]
    x_offset = exponent.to(tl.float32, bitcast=True)[None, None, None, :, None]  # c = 2^(23 - pos)
    if not HAS_ZERO:
        x_offset += 1 << (BITS - 1)  # symmetric: the midpoint too
    # c * x per row and unit (shared by the columns) where it costs less than f - c per weight (AOT counts)
    F_OFFSET: tl.constexpr = ROWS <= 2 or BLOCK_N >= 8
    if GROUP == 0:  # one scale (and zero) per column for all of K
        s_end = tl.load(s_ptr + rows_n * stride_sn).to(tl.float32)
        if HAS_ZERO:
            zw = tl.load(z_ptr + rows_n * stride_sn).to(tl.float32)[None, None, :]
        else:
            zw = 0.0
    else:
        s_end = 1.0
    acc0 = tl.zeros([W, G, BLOCK_N], tl.float32)
    acc1 = tl.zeros([W, G, BLOCK_N], tl.float32)
    acc2 = tl.zeros([W, G, BLOCK_N], tl.float32)
    acc3 = tl.zeros([W, G, BLOCK_N], tl.float32)
    k_start, k_end = split_range(k, k_per_split, SPLITS)  # this program's part of K (kernels.split_k)
    # The next step's words are loaded before this step's math (registers, not a shared-memory pipeline):
    # two steps of weight bytes in flight per program.
    # kernels.pdl: the first step's weights (which no kernel writes) load before the wait for the kernel before.
    let_next_launch(PDL)
    words, s, z = _gemv_step_loads(w_ptrs, s_ptr, z_ptr, s_offs, word, offs_g, k_start, k, k_start < k_end, P, SUB,
                                   GROUP, HAS_ZERO, EVEN_K)
    wait_for_previous(PDL)
    for start in range(k_start, k_end, BLOCK_K):
        next_words, next_s, next_z = _gemv_step_loads(w_ptrs, s_ptr, z_ptr, s_offs, word, offs_g, start + BLOCK_K,
                                                      k, start + BLOCK_K < k_end, P, SUB, GROUP, HAS_ZERO, EVEN_K)
        if GROUP != 0 and HAS_ZERO:
            zw = z
        elif GROUP != 0:
            zw = 0.0
        bits = words.to(tl.uint32, bitcast=True)
        f = ((((bits << shift_left) >> shift_right) & slot_mask) | slot_exponent).to(tl.float32, bitcast=True)
        if not F_OFFSET:  # q itself (exactly), once for all the rows: fewer instructions than c * x per row
            f -= x_offset
        x_mask = start + feature < k
        if HAS_PERM:  # act-order: the weight's feature j is the input's feature perm[j]
            # Loaded in the words' layout (one element per thread and slot, as the hint makes it): the gathered
            # x then is too. As 16-byte vectors both would cross threads through shared memory every step.
            cols = tl.load(perm_ptr + tl.max_contiguous(start + feature, [1, 1, 1, 1, 1]), mask=x_mask, other=0)
        else:
            cols = start + feature
        acc0 = _gemv_row(acc0, f, zw, x_ptr, cols, x_mask, s, x_offset, GROUP, HAS_ZERO, F_OFFSET)
        if ROWS > 1:
            acc1 = _gemv_row(acc1, f, zw, x_ptr + stride_xm, cols, x_mask, s, x_offset, GROUP, HAS_ZERO, F_OFFSET)
        if ROWS > 2:
            acc2 = _gemv_row(acc2, f, zw, x_ptr + 2 * stride_xm, cols, x_mask, s, x_offset, GROUP, HAS_ZERO,
                             F_OFFSET)
        if ROWS > 3:
            acc3 = _gemv_row(acc3, f, zw, x_ptr + 3 * stride_xm, cols, x_mask, s, x_offset, GROUP, HAS_ZERO,
                             F_OFFSET)
        words, s, z = next_words, next_s, next_z
    # Split partials [SPLITS, ROWS, n]; an arrival counter per column tile and row.
    arrival = arrivals_ptr + tl.program_id(0) * ROWS
    split_stride = ROWS * n
    _gemv_store(out_ptr, acc0, s_end, offs_n, n_mask, part_ptr, arrival, split_stride, GROUP, SPLITS)
    if ROWS > 1:
        _gemv_store(out_ptr + stride_om, acc1, s_end, offs_n, n_mask, part_ptr + n, arrival + 1, split_stride, GROUP,
                    SPLITS)
    if ROWS > 2:
        _gemv_store(out_ptr + 2 * stride_om, acc2, s_end, offs_n, n_mask, part_ptr + 2 * n, arrival + 2, split_stride,
                    GROUP, SPLITS)
    if ROWS > 3:
        _gemv_store(out_ptr + 3 * stride_om, acc3, s_end, offs_n, n_mask, part_ptr + 3 * n, arrival + 3, split_stride,
                    GROUP, SPLITS)


def _block_k(group: int, widest: int, narrowest: int) -> int:
    """The widest step in [narrowest, widest] (powers of 2) that a group spans whole, else `widest` with the
    scales gathered per feature (narrower steps would starve the loads more than the gather costs)."""
    if group == 0:
        return widest
    step = widest
    while step >= narrowest:
        if group % step == 0:
            return step
        step //= 2
    return widest


def _group_of(k: int, scale: torch.Tensor) -> int:
    groups = scale.shape[1]
    return 0 if groups == 1 else k // groups


def _check(x, weight_packed, scale, zero, perm, bits) -> tuple[int, int, int]:
    rows, k = x.shape
    n = weight_packed.shape[0]
    assert bits in (4, 8) and weight_packed.shape[1] * (32 // bits) == k, (weight_packed.shape, k, bits)
    assert x.stride(-1) == 1 and weight_packed.is_contiguous() and scale.is_contiguous() and scale.shape[0] == n
    assert k % scale.shape[1] == 0 and (zero is None or zero.shape == scale.shape)
    assert perm is None or perm.shape == (k,)
    return rows, n, k


def skinny_int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    perm: torch.Tensor | None, bits: int,
                    config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [rows <= 16, k] (bf16/fp16) @ dequant(weight).T; config = (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    rows, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    assert rows <= SKINNY_MAX_ROWS
    group = _group_of(k, scale)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    # As many weight bytes per step as the 16-bit skinny GEMM's 256-wide steps: 4x (int4) the features,
    # capped where the unpacked tile would spill registers.
    block_n, block_k, num_warps, num_stages = config or (32, _block_k(group, 256, 128), 4, 4)
    _skinny_int_kernel[(triton.cdiv(n, block_n),)](
        x, weight_packed, scale, zero if zero is not None else scale, perm if perm is not None else weight_packed,
        out, rows, n, k, x.stride(0), weight_packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, HAS_PERM=perm is not None,
        BLOCK_M=SKINNY_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out


GEMV_MAX_ROWS = 4

GemvConfig = tuple[int, int, int, int, int]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages, splits of K: kernels.split_k)."""


_TUNED_GEMV = {
    # (n, k, rows <= 2, bits, group): the best of `benchmarks/w4a16_gemm.py --rows 1,4 --sweep` on the H200
    # (2026-12-02, this kernel) for Llama-3.1-8B's projections (qkv, o, gate_up, down); 1 row stands for 1-2,
    # 4 rows for 3-4 (at 4 rows the four sum to ~117 us against bf16's 155; the defaults took 185).
    (6144, 4096, True, 4, 128): (8, 1024, 2, 1), (4096, 4096, True, 4, 128): (4, 1024, 2, 1),
    (28672, 4096, True, 4, 128): (8, 1024, 1, 1), (4096, 14336, True, 4, 128): (8, 2048, 4, 1),
    (6144, 4096, False, 4, 128): (8, 1024, 2, 1), (4096, 4096, False, 4, 128): (8, 1024, 2, 1),
    (28672, 4096, False, 4, 128): (4, 1024, 1, 1), (4096, 14336, False, 4, 128): (8, 1024, 2, 1),
}


def gemv_key(n: int, k: int, rows: int, bits: int, group: int) -> str:
    """The swept tiles table's key: the shape, a row count of GEMV_TUNED_ROWS, the bits and the group size."""
    return f"{n}x{k},rows={rows},int{bits},g{group}"


GEMV_TUNED_ROWS = (1, 4)
"""The row counts benchmarks/w4a16_gemm.py sweeps: 1 stands for 1-2 rows, 4 for 3-4."""


def _gemv_config(n: int, k: int, bits: int, group: int, rows: int, device: torch.device) -> GemvConfig:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, splits): the device's swept tiles for the shape
    (kernels/configs/int_gemv_<device>.json, from `benchmarks/w4a16_gemm.py --graph-sweep --out`), else
    _TUNED_GEMV's, else 2 warps, each thread loading a unit of 4 words per column and step (16 bytes; 2 from 3
    rows, for the registers), which keeps the words' and x's layouts one (_gemv_unit). 8 columns per program
    (~126 registers at 1-2 rows, ~170 at 3-4) only where that still makes 8 programs per SM of an H100/H200 (132
    SMs), else 4, 2 for small n: whole waves, and bytes in flight on every SM. From the AOT compile for sm_90
    (main-loop instructions per weight)."""
    swept = swept_tiles("int_gemv", device, gemv_key(n, k, 1 if rows <= 2 else 4, bits, group))
    if swept is not None:
        return swept
    tuned = _TUNED_GEMV.get((n, k, rows <= 2, bits, group))
    if tuned is not None:
        return (*tuned, 1)
    block_k = (8192 if rows <= 2 else 4096) // bits
    while group and block_k % group and group % block_k:
        block_k //= 2  # whole groups per step, or steps inside one group
    block_n = 8 if triton.cdiv(n, 8) >= 8 * 132 else 4
    if triton.cdiv(n, block_n) < 2 * 132:
        block_n = 2
    return block_n, block_k, 2, 1, 1


def _gemv_unit(bits: int, group: int, block_k: int, num_warps: int) -> int:
    """The GEMV's words per unit (a thread's load per column): 4, 2 or 1, the most that a scale's features span
    whole and that still give every thread a unit per column and step (with fewer, the spare threads would
    split x's loads from the words' layout: a shared-memory round trip each step)."""
    sub = min(group or block_k, block_k)
    words = 4
    while words > 1 and (sub % (words * 32 // bits) or block_k // (words * 32 // bits) < 32 * num_warps):
        words //= 2
    return words


def gemv_int(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
             perm: torch.Tensor | None, bits: int, config: tuple[int, ...] | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows <= 4, k] (bf16/fp16) @ dequant(weight).T on the CUDA cores, into `out` [rows, n] if given (rows of a
    larger output); config = (BLOCK_N, BLOCK_K, num_warps, num_stages[, splits]), powers of 2 but the splits.
    BLOCK_K must be a multiple of the group size or divide it; steps that divide k keep the weight loads unmasked
    along k."""
    rows, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    assert rows <= GEMV_MAX_ROWS
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    assert out.shape == (rows, n) and out.stride(1) == 1
    if rows == 0:
        return out
    group = _group_of(k, scale)
    block_n, block_k, num_warps, num_stages, *rest = config or _gemv_config(n, k, bits, group, rows, x.device)
    assert group == 0 or block_k % group == 0 or group % block_k == 0, (group, block_k)
    splits = min(rest[0] if rest else 1, -(-k // block_k))  # (integer ceilings: triton.cdiv is ~1.5 us a call)
    tiles = -(-n // block_n)
    partials, arrivals = split_buffers(out, splits, rows, n, tiles * rows)
    words_per_unit = _gemv_unit(bits, group, block_k, num_warps)
    _gemv_int_kernel[(tiles, splits)](
        x, weight_packed, scale, zero if zero is not None else scale, perm if perm is not None else weight_packed,
        out, partials, arrivals, n, k, k_per_split(k, splits, block_k), x.stride(0), weight_packed.stride(0),
        scale.stride(0), out.stride(0), 0,
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, HAS_PERM=perm is not None, ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, H=words_per_unit, SPLITS=splits,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x.device),
    )
    return out


def _dequant_config(bits: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): 1,024 words per program (8 per thread at 4 warps), 64 per row, or fewer where
    a step inside one group (down to 16 words: group 128 of int4) loads one scale per row rather than one per word
    (gathered, and sent through shared memory to the stores' layout: the AOT compile for sm_90). A first choice,
    pending a sweep on the H200."""
    widest = 64 * (32 // bits)
    block_k = _block_k(group, widest, widest // 4)
    return 16 * widest // block_k, block_k, 4


def dequantize_int_weight(weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                          out: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """dequant(weight) [n, k] into `out` (contiguous, 16-bit), in one pass over the packed words: columns in the
    packed order (act-order: multiply x[:, perm] by it). config = (BLOCK_N, BLOCK_K, num_warps), powers of 2."""
    n, words = weight_packed.shape
    k = words * (32 // bits)
    assert bits in (4, 8) and weight_packed.is_contiguous() and scale.is_contiguous() and scale.shape[0] == n
    assert out.shape == (n, k) and out.is_contiguous() and out.dtype in (torch.bfloat16, torch.float16)
    group = _group_of(k, scale)
    block_n, block_k, num_warps = config or _dequant_config(bits, group)
    assert block_k >= 32 // bits and group % (32 // bits) == 0, (group, block_k)  # a word in one group
    _dequant_int_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight_packed, scale, zero if zero is not None else scale, out, n, k,
        weight_packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZERO=zero is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )
    return out


def dequant_int_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                     perm: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x [m, k] (bf16/fp16) @ dequant(weight).T: the weight dequantized into the device's shared scratch
    (kernels.dequant_scratch), then a dense GEMM (cuBLAS) at the 16-bit weight's speed. Act-order gathers x's
    columns into the weight's order (x[:, perm], m * k elements: small beside the GEMM)."""
    m, n, k = _check(x, weight_packed, scale, zero, perm, bits)
    w = dequantize_int_weight(weight_packed, scale, zero, bits, dequant_scratch(x.device, x.dtype, n, k))
    if perm is not None:
        x = x.index_select(1, perm)
    return torch.mm(x, w.t())


_SKINNY_DOES_NOT_FIT: set[tuple] = set()
"""(n, k, bits, group, zero points) whose skinny tiles need more shared memory than the device has (with zero
points at a small k: a Q4_1 GGUF on the H200 asked 249,856 bytes of Hopper's 232,448)."""


def gemv_int_up_to_8_rows(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor | None, perm: torch.Tensor | None, bits: int) -> torch.Tensor:
    """gemv_int for up to 2 * GEMV_MAX_ROWS rows: one launch, or two of at most 4 rows each."""
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS:
        return gemv_int(x, weight_packed, scale, zero, perm, bits)
    out = torch.empty((rows, weight_packed.shape[0]), dtype=x.dtype, device=x.device)
    gemv_int(x[:GEMV_MAX_ROWS], weight_packed, scale, zero, perm, bits, out=out[:GEMV_MAX_ROWS])
    gemv_int(x[GEMV_MAX_ROWS:], weight_packed, scale, zero, perm, bits, out=out[GEMV_MAX_ROWS:])
    return out


def int_weight_gemm(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    perm: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The layer's entry, chosen by the row count only (CUDA graphs capture it). Int4 weights of group 128 or
    per-channel without act-order (most GPTQ / AWQ checkpoints) go to the tensor-core GEMV (kernels.int4_mma_gemv)
    from the shape's fewest rows (its swept table: where it beats the CUDA-core GEMV) up to 8. Otherwise, on
    Llama-3.1-8B's four projections at int4 g128 (H200, BENCHMARKS.md), against bf16's ~154 us:
    - up to GEMV_MAX_ROWS rows, the GEMV (~70 us at one row, ~117 at four);
    - 5-8 rows, the GEMV twice (each launch reads the weight again: ~190-235 us, where the skinny kernel takes
      ~290-310 and the dequantization ~360-450);
    - 9-16 rows, the skinny tensor-core kernel (~296 us) where its tiles fit the device;
    - more rows, or skinny tiles that do not fit, the dequantization then cuBLAS: one pass over the weight whatever
      the rows, then bf16's speed (a tiled kernel unpacking the weight per tile of rows was 2-6x slower than bf16
      at 32+ rows, and slower than this at every count measured: it was removed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    if mma_gemv_takes(x, weight_packed, scale, perm, bits):
        return gemv_int4_mma(x, weight_packed, scale, zero)
    if rows <= 2 * GEMV_MAX_ROWS:
        return gemv_int_up_to_8_rows(x, weight_packed, scale, zero, perm, bits)
    shape_key = (*weight_packed.shape, bits, scale.shape[1], zero is not None)
    if rows <= SKINNY_MAX_ROWS and shape_key not in _SKINNY_DOES_NOT_FIT:
        try:
            return skinny_int_gemm(x, weight_packed, scale, zero, perm, bits)
        except triton.runtime.errors.OutOfResources:  # raised before the launch: nothing was queued
            _SKINNY_DOES_NOT_FIT.add(shape_key)
    return dequant_int_gemm(x, weight_packed, scale, zero, perm, bits)


fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
