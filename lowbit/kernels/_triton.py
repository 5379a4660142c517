"""Triton, when installed, and the one decision every kernel wrapper makes: launch a kernel or use the reference.

The public ops (lowbit.kernels) launch kernels for CUDA tensors only. The internal launchers also run on CPU tensors
under Triton's interpreter, which tests use: TRITON_INTERPRET=1 must be set before triton is first imported (Triton
builds its own library functions, tl.sum etc., for the interpreter or the compiler at import).
Kernels are decorated with `kernel` instead of `triton.jit`, so that mode is chosen at launch, not at our import.
"""
import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is the optional `kernels` extra; without it every op runs its torch reference
    triton = None
    tl = SimpleNamespace(constexpr=None)

HAS_TRITON = triton is not None
_BUILT_FOR_INTERPRETER = HAS_TRITON and type(tl.sum).__name__ == "InterpretedFunction"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 set before triton's import)."""
    return _BUILT_FOR_INTERPRETER and os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_gpu(x: torch.Tensor) -> bool:
    """The public ops' test: launch kernels for CUDA tensors, use the torch reference otherwise."""
    return HAS_TRITON and x.is_cuda


def use_triton(x: torch.Tensor) -> bool:
    """The internal launchers' test: a CUDA tensor, or a CPU tensor under the interpreter."""
    return HAS_TRITON and (x.is_cuda or interpreting())


class kernel:
    """A lazily built Triton kernel: `kernel(fn)[grid](*args)` compiles or interprets fn on first use."""

    def __init__(self, fn):
        self.fn = fn
        self._built = {}

    def __getitem__(self, grid):
        mode = "interpret" if interpreting() else "jit"
        if mode not in self._built:
            if mode == "interpret":
                from triton.runtime.interpreter import InterpretedFunction
                self._built[mode] = InterpretedFunction(self.fn)
            else:
                self._built[mode] = triton.jit(self.fn)
        return self._built[mode][grid]


def helper(fn):
    """A @triton.jit function called from kernels (built for whichever mode triton was imported in)."""
    return triton.jit(fn) if HAS_TRITON else fn


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
