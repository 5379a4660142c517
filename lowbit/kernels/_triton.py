"""Triton, when installed, and the one decision every kernel wrapper makes: launch a kernel or use the reference.

The public ops (lowbit.kernels) launch kernels for CUDA tensors only. The internal launchers also run on CPU tensors
under Triton's interpreter, which tests use: TRITON_INTERPRET=1 must be set before triton is first imported (Triton
builds its own library functions, tl.sum etc., for the interpreter or the compiler at import).
Kernels are decorated with `kernel` instead of `triton.jit`, so that mode is chosen at launch, not at our import.

Programmatic dependent launch (PDL, Hopper and later). Every kernel takes a `PDL: tl.constexpr` parameter and calls
`wait_for_producers(PDL)` before it reads anything an earlier kernel wrote and before it writes anything; before
that call it may read only weights (never written while serving). The call waits for the kernels before it (a no-op
unless this kernel was launched early) and lets the next kernel launch early. `early_kernel`s are launched early:
the M = 1 GEMVs (w4_gemv, dense_gemv), whose first weight tiles then stream in while the small kernel before them
finishes. Inside `all_kernels_early()` every kernel is: the decode graphs of the smallest batches are captured so
(lowbit.serve.cuda_graphs); at batch 16-256 it is slower. LOWBIT_PDL=0: no PDL.
"""
import contextlib
import inspect
import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is the optional `kernels` extra; without it every op runs its torch reference
    triton = None
    tl = SimpleNamespace(constexpr=None)
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no triton, or one without grid dependency control: kernels launch without PDL
    gdc_launch_dependents = gdc_wait = None

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


_CAPABILITY: dict = {}  # torch.device -> its CUDA capability


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (asked once per device)."""
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


_PDL_ON: bool | None = None  # decided once, at the first compiled launch (every launch asks)


def pdl_enabled() -> bool:
    """PDL on for compiled launches: kernels wait for their producers and early_kernels launch early. On a Hopper or
    later GPU (the current one when first asked) with a Triton that has grid dependency control, unless
    LOWBIT_PDL=0."""
    global _PDL_ON
    if _PDL_ON is None:
        _PDL_ON = gdc_wait is not None and os.environ.get("LOWBIT_PDL", "1") != "0" and \
            torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return _PDL_ON


_ALL_EARLY = False  # inside all_kernels_early()


@contextlib.contextmanager
def all_kernels_early(on: bool = True):
    """Within this block (when on), every kernel launched is launched early under PDL, not only early_kernels."""
    global _ALL_EARLY
    before, _ALL_EARLY = _ALL_EARLY, on
    try:
        yield
    finally:
        _ALL_EARLY = before


class kernel:
    """A lazily built Triton kernel: `kernel(fn)[grid](*args)` compiles or interprets fn on first use, passing its
    PDL argument from pdl_enabled(); launch_early: also launched as a programmatic dependent; do_not_specialize:
    parameter names Triton compiles for any value (by default it builds variants for 1 and multiples of 16)."""

    def __init__(self, fn, launch_early: bool = False, do_not_specialize: tuple[str, ...] = ()):
        assert "PDL" in inspect.signature(fn).parameters, f"{fn.__name__}: every kernel takes PDL (module docstring)"
        self.fn = fn
        self.launch_early = launch_early
        self.do_not_specialize = do_not_specialize  # integer arguments compiled for any value (not for 1, 16k)
        self._built = {}

    def __getitem__(self, grid):
        mode = "interpret" if interpreting() else "jit"
        if mode not in self._built:
            if mode == "interpret":
                from triton.runtime.interpreter import InterpretedFunction
                self._built[mode] = InterpretedFunction(self.fn)
            else:
                self._built[mode] = triton.jit(self.fn, do_not_specialize=self.do_not_specialize)
        launch = self._built[mode][grid]
        pdl = mode == "jit" and pdl_enabled()
        options = {"launch_pdl": True} if pdl and (self.launch_early or _ALL_EARLY) else {}
        return lambda *args, **kwargs: launch(*args, PDL=pdl, **options, **kwargs)


def early_kernel(fn):
    """A `kernel` launched early under PDL: it starts while the kernel before it finishes."""
    return kernel(fn, launch_early=True)


def helper(fn):
    """A @triton.jit function called from kernels (built for whichever mode triton was imported in)."""
    return triton.jit(fn) if HAS_TRITON else fn


@helper
def split2(t):
    """[..., 2k] -> the even and the odd elements of the last axis ([..., k] each)."""
    return tl.split(tl.reshape(t, t.shape[:-1] + (t.shape[-1] // 2, 2)))


@helper
def split4(t):
    """[..., 4] -> 4 tensors [...] (element i of the last axis)."""
    a, b = split2(t)  # a: i = 0, 2; b: i = 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@helper
def wait_for_producers(PDL: tl.constexpr):
    """Under PDL: wait until the kernels before this one in the stream have finished and their writes are visible
    (they waited in turn), then let the next kernel launch if it is launched early."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@helper
def load_streamed(ptrs, mask, MASKED: tl.constexpr):
    """Weights read once per step, kept in L2 only (.cg). MASKED: 0 where mask is false (else mask is not read)."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.load(ptrs, cache_modifier=".cg")


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
