"""Ahead-of-time compiles for sm_90 on a machine without a GPU (Triton's ptxas): what a kernel's PTX and resources
would be on Hopper, for the CPU tests that check them."""

from __future__ import annotations


def compile_for_hopper(kernel, pointers: dict[str, str], constants: dict, floats: tuple[str, ...] = (),
                       aligned: tuple[str, ...] = (), num_warps: int = 4):
    """The compiled kernel (Triton or Gluon) for sm_90. `pointers` maps pointer arguments to element types
    ("bf16", "i32", ...), `constants` the constexprs; arguments in `floats` are fp32, the rest i32; the pointers and
    `aligned` are marked divisible by 16. A constant PDL also sets the launch_pdl option (kernels.pdl)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814
    names = kernel.arg_names
    signature = {name: f"*{pointers[name]}" if name in pointers else "constexpr" if name in constants
                 else "fp32" if name in floats else "i32" for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in [*pointers, *aligned]}
    fixed = {(names.index(name),): value for name, value in constants.items()}
    options = {"num_warps": num_warps, "launch_pdl": constants.get("PDL", False)}
    return triton.compile(ASTSource(kernel, signature, fixed, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)
