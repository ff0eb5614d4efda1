"""Decode GEMV for 4-bit integer weights on the tensor cores: y = x @ dequant(W).T for x [rows <= 8, k].

The CUDA-core GEMV (kernels.w4a16_gemm.gemv_int) spends ~3.4 instructions a weight (an and-or to a float, an fma,
the words' shifts, x's conversions): on an H200 that is about the issue rate at which the weight bytes arrive, so
its four Llama-8B projections read at ~40-60% of the copy rate. Here the unpacking is half an instruction a weight:
one and-or makes two bf16 (or fp16) weights at once, 128 + q (1024 + q) exactly (the nibble in the mantissa under
the exponent of 128 (1024)), and a tensor-core mma (m16n8k16) multiplies 16 columns by x's rows (up to 8: the mma's
n; rows past `rows` read the last one again and are not stored). The weights are the mma's A operand and x its
B. Per group of 128 features and column: acc += scale * (sum (128 + q) x - (128 + zero) * sum x), with sum x from a
second mma against ones (it lands in the accumulator's layout: nothing to convert), zero = 8 if symmetric. ~1.3
instructions a weight at 64 columns a warp (the AOT compile for sm_90). Measured on an H100 it reads ~2 TB/s
whatever the rows up to 8 (the CUDA-core GEMV: ~2.3 TB/s at one row, half that at four): it waits on memory, not
on instructions, and the swept table gives it the shapes from the row count where it wins (2-3).

Written in Gluon (Triton's layout-explicit dialect) because the mma wants each thread's weights in its operand
layout: lane (g, t) of a warp loads words 4t..4t+3 of a group for columns g and g + 8 (16 bytes each), and the
unpacked tensor is arranged so that this is already the operand's layout (converted with assert_trivial: no
shared memory, no shuffles). Feature order inside a group follows the words (k = 32 j + 16 s1 + 8 s0 + 2 t + h is
nibble s = 2 s1 + s0 (+4 for h) of word 4 t + j), and x is loaded in that same order (16-byte loads, then
register permutes).

For int4 weights in layers.quant.w4a16's layout (GPTQ, AWQ, compressed-tensors pack-quantized), group 128 or
per-channel, without act-order, with 16-bit activations, on sm_80+ (mma.sync). Others take gemv_int.
"""

from __future__ import annotations

import functools

import torch

from tokenmill.kernels import fix_cache_keys
from tokenmill.kernels.pdl import pdl_launch
from tokenmill.kernels.split_k import split_buffers
from tokenmill.kernels.tile_tables import swept_tiles

try:  # Gluon: triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - the engine pins a triton that has it
    gluon = None

MMA_MAX_ROWS = 8  # the mma's n
GROUP = 128  # features per mma chain (and per scale, for group-128 weights)

MmaConfig = tuple[int, int, int, int]
"""(TM: 16-column tiles per warp, warps per program, splits of K, KG: groups per step)."""


if gluon is not None:

    # Layouts are built at compile time from the tile's constants: as kernel arguments they would not serialise
    # into the specialisation that kernels.precompile records.
    @gluon.constexpr_function
    def _words_layout(tm, num_warps):
        """The words' layout [M columns, 4 t, 4 j, 4 shifts]: each lane its 4 words of a group per column (t and
        the column's low 3 bits from the lane), in registers the shifts, j, the column + 8 and the tiles."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [8, 0, 0, 0]]
            + [[16 * num_warps << i, 0, 0, 0] for i in range(tm.bit_length() - 1)],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16 << i, 0, 0, 0] for i in range(num_warps.bit_length() - 1)], block_bases=[],
            shape=[16 * tm * num_warps, 4, 4, 4])

    @gluon.constexpr_function
    def _x_layout(num_warps):
        """x's layout [8 rows, 4 t, 4 j, 8 features]: the same lanes as the words', 16 bytes a load."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0]],
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[0, 0, 0, 0]] * (num_warps.bit_length() - 1), block_bases=[], shape=[8, 4, 4, 8])

    @gluon.jit
    def _griddepcontrol(OP: gl.constexpr):
        """kernels.pdl's launch_dependents / wait, which are Triton (not Gluon) functions."""
        gl.inline_asm_elementwise("griddepcontrol." + OP.value + "; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _group(acc, words, x_ptrs, s_ptrs, z_ptrs, ones, magic, offset, GROUPED: gl.constexpr,
               HAS_ZERO: gl.constexpr, W_LAYOUT: gl.constexpr):
        """acc += one group's contribution (per-channel weights: unscaled)."""
        mma: gl.constexpr = acc.type.layout
        m: gl.constexpr = acc.shape[0]
        dtype: gl.constexpr = ones.dtype
        xv = gl.reshape(gl.load(x_ptrs), [8, 4, 4, 2, 2, 2])  # row, t, j, h, s1, s0
        xv = gl.permute(xv, [2, 4, 5, 1, 3, 0])  # j, s1, s0, t, h, row
        b = gl.convert_layout(gl.reshape(xv, [128, 8]), gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                              assert_trivial=True)
        shifts = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, W_LAYOUT)))) * 4
        u = words.to(gl.uint32, bitcast=True)[:, :, :, None] >> shifts.to(gl.uint32)[None, None, None, :]
        pairs = (u & 0x000F000F) | magic  # nibbles s and s + 4 as two 16-bit floats: one LOP3
        low = (pairs & 0xFFFF).to(gl.uint16).to(dtype, bitcast=True)
        high = (pairs >> 16).to(gl.uint16).to(dtype, bitcast=True)
        wv = gl.reshape(gl.join(low, high), [m, 4, 4, 2, 2, 2])  # column, t, j, s1, s0, h
        wv = gl.permute(wv, [0, 2, 3, 4, 1, 5])  # column, j, s1, s0, t, h
        a = gl.convert_layout(gl.reshape(wv, [m, 128]), gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                              assert_trivial=True)
        zero = gl.zeros([m, 8], gl.float32, layout=mma)
        dots = mma_v2(a, b, zero)
        x_sums = mma_v2(ones, b, zero)
        if HAS_ZERO:
            dots -= (offset + gl.load(z_ptrs).to(gl.float32))[:, None] * x_sums
        else:
            dots -= (offset + 8.0) * x_sums
        if GROUPED:
            return acc + dots * gl.load(s_ptrs).to(gl.float32)[:, None]
        return acc + dots

    @gluon.jit
    def _load_step(w_ptrs, KG: gl.constexpr):
        """The words of KG (1, 2 or 4) consecutive groups, 16 words of each column a group: always four tensors
        (one type for every KG); past KG they repeat the first groups and go unused (those loads are dropped)."""
        return (gl.load(w_ptrs), gl.load(w_ptrs + 16 * (1 % KG)), gl.load(w_ptrs + 16 * (2 % KG)),
                gl.load(w_ptrs + 16 * (3 % KG)))

    @gluon.jit
    def _step(acc, words, x_ptrs, s_ptrs, z_ptrs, ones, magic, offset, KG: gl.constexpr, GROUPED: gl.constexpr,
              HAS_ZERO: gl.constexpr, W_LAYOUT: gl.constexpr):
        """acc += KG consecutive groups' contributions, from their words (x, scales and zeros loaded here)."""
        G_STEP: gl.constexpr = 1 if GROUPED else 0
        for g in gl.static_range(KG):
            acc = _group(acc, words[g], x_ptrs + g * 128, s_ptrs + g * G_STEP, z_ptrs + g * G_STEP, ones, magic,
                         offset, GROUPED, HAS_ZERO, W_LAYOUT)
        return acc

    @gluon.jit(do_not_specialize=["no_bits"])
    def _int4_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, part_ptr, arrivals_ptr, n, stride_xm, stride_om,
                              no_bits, K: gl.constexpr, ROWS: gl.constexpr, TM: gl.constexpr, SPLITS: gl.constexpr,
                              KG: gl.constexpr, GROUPED: gl.constexpr, HAS_ZERO: gl.constexpr,
                              PDL: gl.constexpr = False):
        # K and the strides it sets are constants, so every load's address is a lane's base plus an immediate.
        STRIDE_WN: gl.constexpr = K // 8
        STRIDE_SN: gl.constexpr = K // 128 if GROUPED else 1
        GROUPS: gl.constexpr = K // 128 // SPLITS  # this program's
        NW: gl.constexpr = gl.num_warps()
        M: gl.constexpr = 16 * TM * NW
        W_LAYOUT: gl.constexpr = _words_layout(TM, NW)
        X_LAYOUT: gl.constexpr = _x_layout(NW)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        if dtype == gl.float16:
            magic = (0x64006400 + no_bits).to(gl.uint32)  # 1024.0 twice; `no_bits` keeps it in a register (LOP3)
            offset = 1024.0
        else:
            magic = (0x43004300 + no_bits).to(gl.uint32)  # 128.0 twice
            offset = 128.0
        tile = gl.program_id(0)
        split = gl.program_id(1)
        W3: gl.constexpr = gl.SliceLayout(3, W_LAYOUT)
        wm = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3)))
        wt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
        wj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
        w_ptrs = (w_ptr + (tile * M * STRIDE_WN + split * GROUPS * 16)) + (
            wm[:, None, None].to(gl.int64) * STRIDE_WN + (wt[None, :, None] * 4 + wj[None, None, :]))
        X3: gl.constexpr = gl.SliceLayout(3, X_LAYOUT)
        xn = gl.minimum(gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3))), ROWS - 1)
        xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
        xj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
        xf = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, X_LAYOUT))))
        x_ptrs = (x_ptr + split * GROUPS * 128) + (
            xn[:, None, None, None] * stride_xm + xt[None, :, None, None] * 32 + xj[None, None, :, None] * 8
            + xf[None, None, None, :])
        cols = gl.arange(0, M, layout=gl.SliceLayout(1, mma))
        first_group = split * GROUPS if GROUPED else 0
        s_ptrs = (s_ptr + (tile * M * STRIDE_SN + first_group)) + cols * STRIDE_SN
        z_ptrs = (z_ptr + (tile * M * STRIDE_SN + first_group)) + cols * STRIDE_SN
        ones = gl.full([M, 128], 1.0, dtype, layout=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
        acc = gl.zeros([M, 8], gl.float32, layout=mma)
        G_STEP: gl.constexpr = 1 if GROUPED else 0  # scales (and zeros) per group, or one per column
        # Steps of KG groups (the words of a step loaded at once: KG * 64 contiguous bytes a column), each step's
        # words loaded while the step before is computed; two steps a turn, so that the words loaded ahead need no
        # register copies.
        STEPS: gl.constexpr = GROUPS // KG
        X_STEP: gl.constexpr = KG * 128
        S_STEP: gl.constexpr = KG * G_STEP
        # kernels.pdl: the first step's words (which no kernel writes) load before the wait for the kernel before.
        if PDL:
            _griddepcontrol("launch_dependents")
        current = _load_step(w_ptrs, KG)
        if PDL:
            _griddepcontrol("wait")
        for _ in range(STEPS // 2 - 1):
            ahead = _load_step(w_ptrs + KG * 16, KG)
            acc = _step(acc, current, x_ptrs, s_ptrs, z_ptrs, ones, magic, offset, KG, GROUPED, HAS_ZERO, W_LAYOUT)
            current = _load_step(w_ptrs + 2 * KG * 16, KG)
            acc = _step(acc, ahead, x_ptrs + X_STEP, s_ptrs + S_STEP, z_ptrs + S_STEP, ones, magic, offset, KG,
                        GROUPED, HAS_ZERO, W_LAYOUT)
            w_ptrs += 2 * KG * 16
            x_ptrs += 2 * X_STEP
            s_ptrs += 2 * S_STEP
            z_ptrs += 2 * S_STEP
        if STEPS == 1:
            acc = _step(acc, current, x_ptrs, s_ptrs, z_ptrs, ones, magic, offset, KG, GROUPED, HAS_ZERO, W_LAYOUT)
        else:  # the last two steps, or three
            ahead = _load_step(w_ptrs + KG * 16, KG)
            acc = _step(acc, current, x_ptrs, s_ptrs, z_ptrs, ones, magic, offset, KG, GROUPED, HAS_ZERO, W_LAYOUT)
            if STEPS % 2 == 1:
                current = _load_step(w_ptrs + 2 * KG * 16, KG)
            acc = _step(acc, ahead, x_ptrs + X_STEP, s_ptrs + S_STEP, z_ptrs + S_STEP, ones, magic, offset, KG,
                        GROUPED, HAS_ZERO, W_LAYOUT)
            if STEPS % 2 == 1:
                acc = _step(acc, current, x_ptrs + 2 * X_STEP, s_ptrs + 2 * S_STEP, z_ptrs + 2 * S_STEP, ones, magic,
                            offset, KG, GROUPED, HAS_ZERO, W_LAYOUT)
        if not GROUPED:
            acc = acc * gl.load(s_ptr + tile * M + cols).to(gl.float32)[:, None]
        out_cols = tile * M + cols
        rows = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        mask = (rows < ROWS)[None, :] & (out_cols < n)[:, None]
        if SPLITS == 1:
            gl.store(out_ptr + rows[None, :] * stride_om + out_cols[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=mask)
        else:  # kernels.split_k's protocol: partials [SPLITS, ROWS, n], the last program to arrive adds them in order
            part_ptrs = part_ptr + rows[None, :] * n + out_cols[:, None]
            gl.store(part_ptrs + split * (ROWS * n), acc, mask=mask)
            gl.thread_barrier()
            if gl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                total = gl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for other in gl.static_range(1, SPLITS):
                    total += gl.load(part_ptrs + other * (ROWS * n), mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(out_ptr + rows[None, :] * stride_om + out_cols[:, None], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
                gl.store(arrivals_ptr + tile, 0)


def mma_gemv_key(n: int, k: int, group: int) -> str:
    """The swept tiles table's key (kernels/configs/int4_mma_gemv_<device>.json)."""
    return f"{n}x{k},int4,g{group}"


def _fits(n: int, k: int, config: MmaConfig) -> bool:
    tm, num_warps, splits, kg = config
    return n % (16 * tm * num_warps) == 0 and (k // GROUP) % (splits * kg) == 0 and kg in (1, 2, 4)


DEFAULT_MIN_ROWS = 3
"""Without a swept table, from how many rows the tensor-core GEMV is taken. On an H100 it won from 2 rows (gate_up
from 3): Llama-8B's projections chained, 1.42x the CUDA-core GEMV at 4 rows, 2.49x at 8, 0.86x at 1 (BENCHMARKS.md);
each added row costs the CUDA-core kernel an fma a weight, this one almost nothing."""


@functools.cache
def choice(n: int, k: int, device: torch.device) -> tuple[MmaConfig, int]:
    """(tiles, the fewest rows the tensor-core GEMV takes) for the shape: the device's swept table
    (kernels/configs/int4_mma_gemv_<device>.json, from `benchmarks/w4a16_gemm.py --mma-sweep --out`), else one
    16-column tile a warp, 4 warps, 2 groups a step and K split until every SM holds ~16 warps (bytes in flight;
    the H100's sweep preferred small tiles and many splits)."""
    swept = swept_tiles("int4_mma_gemv", device, mma_gemv_key(n, k, GROUP))
    if swept is not None and _fits(n, k, tuple(swept[:4])):
        return tuple(swept[:4]), swept[4]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    num_warps = 4 if n % 64 == 0 else 2 if n % 32 == 0 else 1
    kg = 2 if (k // GROUP) % 2 == 0 else 1
    splits = 1
    while n // (16 * num_warps) * splits * num_warps < 16 * sms and (k // GROUP) % (2 * splits * kg) == 0:
        splits *= 2
    return (1, num_warps, splits, kg), DEFAULT_MIN_ROWS


@functools.cache
def _has_mma_sync(device: torch.device) -> bool:
    return gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def mma_gemv_takes(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor | None,
                   bits: int) -> bool:
    """Whether int_weight_gemm gives this product to gemv_int4_mma (else to kernels.w4a16_gemm's kernels): int4 of
    group 128 or per-channel without act-order, 16-bit activations, at least the shape's fewest rows (choice) and at
    most 8."""
    if not _has_mma_sync(x.device):
        return False
    rows, k = x.shape
    n = weight_packed.shape[0]
    if not (bits == 4 and perm is None and x.dtype in (torch.bfloat16, torch.float16) and rows <= MMA_MAX_ROWS
            and k % GROUP == 0 and n % 16 == 0 and (scale.shape[1] == 1 or scale.shape[1] * GROUP == k)):
        return False
    return rows >= choice(n, k, x.device)[1]


def gemv_int4_mma(x: torch.Tensor, weight_packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  config: MmaConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows <= 8, k] (bf16/fp16, rows contiguous) @ dequant(weight).T for int4 weights of group 128 or per-channel
    (mma_gemv_takes), into `out` [rows, n] if given; config = (TM, warps, splits, KG: groups a step)."""
    rows, k = x.shape
    n = weight_packed.shape[0]
    assert x.stride(-1) == 1 and weight_packed.is_contiguous() and scale.is_contiguous()
    assert weight_packed.shape[1] * 8 == k and rows <= MMA_MAX_ROWS, (weight_packed.shape, k, rows)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    assert out.shape == (rows, n) and out.stride(1) == 1
    if rows == 0:
        return out
    tm, num_warps, splits, kg = config or choice(n, k, x.device)[0]
    assert _fits(n, k, (tm, num_warps, splits, kg)), (n, k, tm, num_warps, splits, kg)
    tiles = n // (16 * tm * num_warps)
    partials, arrivals = split_buffers(out, splits, rows, n, tiles)
    _int4_mma_gemv_kernel[(tiles, splits)](
        x, weight_packed, scale, zero if zero is not None else scale, out, partials, arrivals, n, x.stride(0),
        out.stride(0), 0, K=k, ROWS=rows, TM=tm, SPLITS=splits, KG=kg, GROUPED=scale.shape[1] > 1,
        HAS_ZERO=zero is not None, num_warps=num_warps, **pdl_launch(x.device))
    return out


if gluon is not None:
    fix_cache_keys(globals())  # see kernels.fix_cache_keys: the same Triton cache keys in every process
