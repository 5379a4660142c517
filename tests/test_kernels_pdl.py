"""Programmatic dependent launch (lowbit.kernels._triton): which kernels wait, which launch early, what they get.
The ordering itself needs a Hopper GPU (the engine checks in tests/test_gpu_engine_*.py run with PDL on there)."""
import ast
import importlib
import inspect
import pkgutil

import pytest

pytest.importorskip("triton")

import lowbit.kernels  # noqa: E402
from lowbit.kernels import _triton  # noqa: E402


def _all_kernels():
    found = []
    for info in pkgutil.walk_packages(lowbit.kernels.__path__, "lowbit.kernels."):
        module = importlib.import_module(info.name)
        short = info.name.rsplit(".", 1)[-1]
        found += [(f"{short}.{name}", k) for name, k in vars(module).items()
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
    fn = ast.parse(inspect.getsource(k.fn)).body[0]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "wait_for_producers"]
    top = [s for s in fn.body if isinstance(s, ast.Expr) and s.value in calls]
    assert len(calls) == 1 and len(top) == 1, f"{name}: wait_for_producers(PDL) once, at the top level"


def test_only_the_gemvs_launch_early():
    """The GEMVs (M = 1 W4 and bf16 / FP8, INT8 at 1-8 rows, the MoE decode path's down GEMV, the one-token router)
    load their first weight step before they wait. Other kernels launch early only inside all_kernels_early (the
    decode graphs of batch 1-2): at batch 4-256 that measured slower (serve_gpu_notes.md)."""
    assert {n for n, k in KERNELS if k.launch_early} == {"w4_gemv._w4_gemv_kernel", "dense_gemv._dense_gemv_kernel",
                                                         "int8_gemv._int8_gemv_kernel", "decode._down_combine_kernel",
                                                         "route._router_topk_kernel"}


@pytest.mark.parametrize("make", [_triton.kernel, _triton.early_kernel])
def test_a_kernel_must_take_pdl(make):
    def no_pdl(x_ptr):
        pass
    with pytest.raises(AssertionError):
        make(no_pdl)


class _Recorder:
    def __init__(self):
        self.kwargs = None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: setattr(self, "kwargs", kwargs)


def _compiled_kernel(monkeypatch, early: bool, pdl: bool):
    """An empty kernel whose compiled launches are recorded (no GPU), with pdl_enabled() forced."""
    def fn(x_ptr, PDL):
        pass
    k = _triton.kernel(fn, launch_early=early)
    rec = k._built["jit"] = _Recorder()
    monkeypatch.setattr(_triton, "interpreting", lambda: False)
    monkeypatch.setattr(_triton, "pdl_enabled", lambda: pdl)
    return k, rec


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("early", [True, False])
def test_launch_options(monkeypatch, enabled, early):
    """Compiled (not interpreted) launches get PDL = pdl_enabled(), and the launch attribute only when early."""
    k, rec = _compiled_kernel(monkeypatch, early, enabled)
    k[(1,)](0, num_warps=2)
    expected = {"PDL": enabled, "num_warps": 2, **({"launch_pdl": True} if enabled and early else {})}
    assert rec.kwargs == expected


@pytest.mark.parametrize("early", [True, False])
def test_all_kernels_early(monkeypatch, early):
    """Inside all_kernels_early() every kernel gets the launch attribute; outside it (and after an error inside it)
    only early_kernels do; all_kernels_early(False) changes nothing."""
    k, rec = _compiled_kernel(monkeypatch, early, pdl=True)
    seen = []
    with pytest.raises(RuntimeError):
        with _triton.all_kernels_early():
            k[(1,)](0)
            seen.append("launch_pdl" in rec.kwargs)
            with _triton.all_kernels_early(False):
                k[(1,)](0)
                seen.append("launch_pdl" in rec.kwargs)
            raise RuntimeError("capture failed")
    k[(1,)](0)
    seen.append("launch_pdl" in rec.kwargs)
    assert seen == [True, early, early]


def test_interpreter_gets_no_pdl(monkeypatch):
    def fn(x_ptr, PDL):
        pass
    k = _triton.early_kernel(fn)
    rec = k._built["interpret"] = _Recorder()
    monkeypatch.setattr(_triton, "interpreting", lambda: True)
    monkeypatch.setattr(_triton, "pdl_enabled", lambda: True)  # even if the host could: the interpreter runs no PTX
    k[(1,)](0)
    assert rec.kwargs == {"PDL": False}


@pytest.mark.parametrize("env,capability,has_gdc,expected", [
    ("1", (9, 0), True, True), ("0", (9, 0), True, False), ("1", (8, 0), True, False), ("1", (9, 0), False, False)])
def test_pdl_switch(monkeypatch, env, capability, has_gdc, expected):
    """PDL needs a Hopper or later GPU and a Triton with grid dependency control; LOWBIT_PDL=0 turns it off."""
    monkeypatch.setattr(_triton, "_PDL_ON", None)  # decided once per process: ask again
    monkeypatch.setattr(_triton.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_triton.torch.cuda, "get_device_capability", lambda: capability)
    monkeypatch.setenv("LOWBIT_PDL", env)
    if not has_gdc:
        monkeypatch.setattr(_triton, "gdc_wait", None)
    assert _triton.pdl_enabled() is expected
