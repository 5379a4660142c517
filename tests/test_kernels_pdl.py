"""Programmatic dependent launch (lowbit.kernels._triton): which kernels wait, which launch early, what they get.
The ordering itself needs a Hopper GPU (the engine checks in tests/test_gpu_engine_*.py run with PDL on there)."""
import ast
import inspect
import pkgutil
import importlib

import pytest

import lowbit.kernels
from lowbit.kernels import _triton


def _all_kernels():
    found = []
    for info in pkgutil.iter_modules(lowbit.kernels.__path__):
        module = importlib.import_module(f"lowbit.kernels.{info.name}")
        found += [(f"{info.name}.{name}", k) for name, k in vars(module).items()
                  if isinstance(k, _triton.kernel) and k.fn.__module__ == module.__name__]
    return found


KERNELS = _all_kernels()


def test_kernels_found():
    names = {n for n, _ in KERNELS}
    assert {"w4_gemv._w4_gemv_kernel", "norm._rms_norm_kernel", "paged_attention._decode_kernel"} <= names
    assert len(KERNELS) >= 15


@pytest.mark.parametrize("name,k", KERNELS, ids=[n for n, _ in KERNELS])
def test_every_kernel_waits_for_its_producers(name, k):
    """Each kernel takes PDL and calls wait_for_producers(PDL) once, at the top level of its body (a call inside a
    branch or loop could be skipped, and a kernel launched early would then race its producer)."""
    assert k.takes_pdl, f"{name} has no PDL parameter"
    fn = ast.parse(inspect.getsource(k.fn)).body[0]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "wait_for_producers"]
    top = [s for s in fn.body if isinstance(s, ast.Expr) and s.value in calls]
    assert len(calls) == 1 and len(top) == 1, f"{name}: wait_for_producers(PDL) once, at the top level"


def test_only_the_gemv_launches_early():
    assert {n for n, k in KERNELS if k.launch_early} == {"w4_gemv._w4_gemv_kernel"}


def test_an_early_kernel_must_take_pdl():
    def no_pdl(x_ptr):
        pass
    with pytest.raises(AssertionError):
        _triton.early_kernel(no_pdl)


class _Recorder:
    def __init__(self):
        self.kwargs = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: setattr(self, "kwargs", kwargs)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("early", [True, False])
def test_launch_options(monkeypatch, enabled, early):
    """Compiled (not interpreted) launches get PDL = pdl_enabled(), and the launch attribute only when early."""
    def fn(x_ptr, PDL):
        pass
    k = _triton.kernel(fn, launch_early=early)
    rec = k._built["jit"] = _Recorder()
    monkeypatch.setattr(_triton, "interpreting", lambda: False)
    monkeypatch.setattr(_triton, "pdl_enabled", lambda: enabled)
    k[(1,)](0, num_warps=2)
    expected = {"PDL": enabled, "num_warps": 2, **({"launch_pdl": True} if enabled and early else {})}
    assert rec.kwargs == expected


def test_interpreter_gets_no_pdl(monkeypatch):
    def fn(x_ptr, PDL):
        pass
    k = _triton.early_kernel(fn)
    rec = k._built["interpret"] = _Recorder()
    monkeypatch.setattr(_triton, "interpreting", lambda: True)
    monkeypatch.setattr(_triton, "pdl_enabled", lambda: True)  # even if the host could: the interpreter runs no PTX
    k[(1,)](0)
    assert rec.kwargs == {"PDL": False}


def test_pdl_switch(monkeypatch):
    """LOWBIT_PDL=0 turns PDL off (read once per process); otherwise it follows the GPU (Hopper or later)."""
    monkeypatch.setattr(_triton, "_PDL_ON", None)
    monkeypatch.setattr(_triton.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_triton.torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setenv("LOWBIT_PDL", "0")
    assert not _triton.pdl_enabled()
    monkeypatch.setattr(_triton, "_PDL_ON", None)
    monkeypatch.setenv("LOWBIT_PDL", "1")
    assert _triton.pdl_enabled()
    monkeypatch.setattr(_triton, "_PDL_ON", None)
    monkeypatch.setattr(_triton.torch.cuda, "get_device_capability", lambda: (8, 0))
    assert not _triton.pdl_enabled()
