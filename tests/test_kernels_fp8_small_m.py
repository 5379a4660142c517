"""FP8 small-M GEMM (lowbit.kernels.linear.fp8_small_m) on CPU under the Triton interpreter, against scaled_gemm_ref:
M = 1..32, ragged N and K, per-tensor / per-row weight scales, per-token x scales, bias, tiles owned by one program
and tiles shared by several (split K in the same launch, programs spanning several tiles). fp16 outputs (the
interpreter truncates fp32 -> bf16); the GPU check is dev/bench/fp8_small_m.py."""

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels.linear import fp8_small_m as fsm, scratch  # noqa: E402
from lowbit.kernels import tuning  # noqa: E402
from lowbit.kernels.linear import w8a8  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear.scaled_gemm import scaled_gemm_ref  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="needs the Triton interpreter (TRITON_INTERPRET=1 before triton's import)")
TOL = 1e-3  # fp32 sums in another order than the reference, one fp16 rounding


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def fp8(t):
    return t.clamp(-448, 448).to(torch.float8_e4m3fn)


def inputs(m, k, n, per_token, per_row, bias, seed):
    g = torch.Generator().manual_seed(seed)
    q = fp8(torch.randn(m, k, generator=g) * 30)
    w = fp8(torch.randn(n, k, generator=g) * 100)
    sa = torch.rand(m, 1, generator=g) * 0.01 + 1e-3 if per_token else torch.tensor(0.01)
    sb = torch.rand(n, 1, generator=g) * 1e-3 + 1e-5 if per_row else torch.tensor(2e-4)  # [N, 1] as fuse.py merges
    b = torch.randn(n, generator=g).half() if bias else None
    return q, w, sa, sb, b


def counters_zero():
    return all(int(ws["counters"].abs().sum()) == 0 for ws in fsm._WORKSPACE.values())


@needs_interpreter
@pytest.mark.parametrize("m,k,n,config,per_token,per_row,bias", [
    (1, 256, 64, (64, 128, 0, 4, 2), False, False, False),  # one program per tile
    (3, 200, 72, (64, 64, 5, 4, 2), False, True, True),  # ragged K and N, tiles split in K
    (16, 512, 130, (64, 128, 4, 4, 2), True, True, True),
    (32, 384, 64, (64, 128, 3, 4, 2), False, True, False),  # M_PAD 32, three parts of one tile
    (7, 1024, 300, (64, 128, 7, 4, 2), False, True, True),  # runs straddling tiles
    (2, 1024, 300, (64, 128, 3, 4, 2), False, False, True),  # a program spanning several tiles
    (17, 640, 300, (64, 128, 11, 4, 2), True, False, False),
    (5, 1000, 1030, None, True, True, True),  # the default config
])
def test_matches_reference(m, k, n, config, per_token, per_row, bias):
    q, w, sa, sb, b = inputs(m, k, n, per_token, per_row, bias, seed=m + k + n)
    out = fsm.fp8_small_m_gemm(q, w, sa, sb, b, torch.float16, config)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel_err(out, scaled_gemm_ref(q, w, sa, sb, b, torch.float16)) < TOL
    assert counters_zero()  # the last program of each shared tile reset its counter


@needs_interpreter
def test_fp16_dot_path_and_repeatable_sums():
    q, w, sa, sb, b = inputs(9, 512, 192, False, True, True, seed=3)
    config = (64, 128, 5, 4, 2)
    first = fsm.fp8_small_m_gemm(q, w, sa, sb, b, torch.float16, config, dot_fp16=True)
    again = fsm.fp8_small_m_gemm(q, w, sa, sb, b, torch.float16, config, dot_fp16=True)
    assert torch.equal(first, again)  # the parts of a tile are summed in a fixed order
    assert rel_err(first, scaled_gemm_ref(q, w, sa, sb, b, torch.float16)) < TOL


@needs_interpreter
def test_bf16_output():
    q, w, sa, sb, _ = inputs(4, 256, 128, False, False, False, seed=4)
    out = fsm.fp8_small_m_gemm(q, w, sa, sb, None, torch.bfloat16, (64, 128, 3, 4, 2))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, scaled_gemm_ref(q, w, sa, sb)) < 1e-2  # interpreter truncation, see module doc


@pytest.mark.parametrize("n,k,programs", [(6144, 4096, 0), (300, 1024, 3), (300, 640, 11), (4096, 14336, 132),
                                          (72, 200, 5)])
def test_split_work_covers_every_unit_once(n, k, programs):
    n_tiles, steps, units, launched, max_parts = fsm.split_work(n, k, 64, 256, programs)
    owners = [u // units for u in range(n_tiles * steps)]
    assert owners[-1] == launched - 1
    parts = [len(set(owners[t * steps:(t + 1) * steps])) for t in range(n_tiles)]
    assert max(parts) <= max_parts and (max_parts == 1) == (max(parts) == 1)


def test_default_configs_on_llama_shapes():
    assert fsm.choose_config(1, 6144, 4096) == (64, 256, 0, 4, 6)
    assert fsm.choose_config(1, 4096, 4096) == (64, 256, 0, 4, 6)
    assert fsm.choose_config(16, 28672, 4096) == (64, 256, 0, 4, 4)
    assert fsm.choose_config(1, 4096, 14336) == (64, 256, 132, 4, 6)


def test_workspace_grows_and_keeps_older_buffers():
    dev = torch.device("cpu")
    key = ("fp8_small_m partials", dev, torch.float32)
    fsm._WORKSPACE.pop(dev, None)
    scratch._BUFFERS.pop(key, None)
    small, counters = fsm._workspace(dev, 100)
    again, _ = fsm._workspace(dev, 50)
    assert again is small and counters.dtype == torch.int32 and int(counters.abs().sum()) == 0
    large, same_counters = fsm._workspace(dev, 1000)
    assert large.numel() >= 1000 and same_counters is counters and large is not small
    assert any(t is small for t in scratch._BUFFERS[key]["retired"])  # graphs captured earlier may point at it


def test_w8a8_scale_kinds_and_cpu_route():
    one, rows, tokens = torch.tensor(0.5), torch.rand(8), torch.rand(3, 1)
    assert w8a8.scale_kind(one, one) == "per_tensor"
    assert w8a8.scale_kind(one, rows) == "per_row"
    assert w8a8.scale_kind(tokens, rows) == "per_token"
    q = fp8(torch.randn(3, 32))
    assert w8a8._arch(q) is None  # CPU tensors never take the GPU-only kernels
    assert w8a8._route(q, fp8(torch.randn(8, 32)), one, rows) == "scaled_gemm"
    assert w8a8._route(q[:1], fp8(torch.randn(8, 32)), one, one) == "scaled_gemm"


@pytest.mark.parametrize("m,n,k,scale_a,routed", [
    (1, 48, 64, "one", True),  # one row, one activation scale: the GEMV
    (1, 48, 64, "token", True),  # a dynamic per-token scale of one row is one scale too
    (2, 48, 64, "one", False),  # two rows: the tensor-core route
    (1, 4096 * 6 + 1, 1024, "one", False),  # over Tuning.fp8_gemv_max_weights
])
def test_one_fp8_row_of_a_small_layer_runs_the_gemv(monkeypatch, m, n, k, scale_a, routed):
    """w8a8_linear_prequantized sends one row of a layer up to Tuning.fp8_gemv_max_weights to fp8_gemv on Hopper
    (the GPU check stubbed, the routes recorded) and everything else to the tensor-core route."""
    q, w = fp8(torch.randn(m, k)), torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    sa = torch.tensor(0.5) if scale_a == "one" else torch.rand(m, 1)
    calls = []
    monkeypatch.setattr(w8a8, "_arch", lambda t: (9, 0))
    monkeypatch.setattr(w8a8, "fp8_gemv", lambda *a: calls.append(("gemv", a[6])))
    for name in ("fp8_small_m_gemm", "scaled_gemm"):
        monkeypatch.setattr(w8a8, name, lambda *a: calls.append(("tensor_core", None)))
    monkeypatch.setitem(w8a8._SCALED_MM, "scaled_mm_rowwise", lambda *a: calls.append(("tensor_core", None)))
    w8a8.w8a8_linear_prequantized(q, w, torch.rand(n), sa, None, torch.bfloat16)
    assert calls == ([("gemv", tuning.current().fp8_gemv_config)] if routed else [("tensor_core", None)])


def int8_inputs(m, k, n, per_token, bias, seed):
    """SmoothQuant's operands: int8 x and weights, one x scale (or one per row), per-channel weight scales."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    sa = torch.rand(m, 1, generator=g) * 0.01 + 1e-3 if per_token else torch.tensor(0.01)
    sb = torch.rand(n, generator=g) * 1e-3 + 1e-4
    b = torch.randn(n, generator=g).half() if bias else None
    return q, w, sa, sb, b


@needs_interpreter
@pytest.mark.parametrize("m,k,n,config,per_token,bias", [
    (9, 512, 130, (64, 128, 0, 4, 2), False, False),  # one program per tile, ragged N
    (16, 640, 72, (64, 128, 5, 4, 2), True, True),  # tiles split in K, finished by the last part
    (32, 1000, 300, (64, 128, 7, 4, 2), False, True),  # M_PAD 32, ragged K, runs straddling tiles
    (24, 384, 64, None, False, False),  # the default config
])
def test_int8_matches_reference(m, k, n, config, per_token, bias):
    q, w, sa, sb, b = int8_inputs(m, k, n, per_token, bias, seed=m + k + n)
    out = fsm.int8_small_m_gemm(q, w, sa, sb, b, torch.float16, config)
    assert out.shape == (m, n) and out.dtype == torch.float16
    assert rel_err(out, scaled_gemm_ref(q, w, sa, sb, b, torch.float16)) < TOL
    assert counters_zero()


@needs_interpreter
def test_int8_fp16_dot_path_matches_the_int32_path():
    q, w, sa, sb, b = int8_inputs(12, 512, 192, False, True, seed=5)
    config = (64, 128, 5, 4, 2)
    exact = fsm.int8_small_m_gemm(q, w, sa, sb, b, torch.float16, config)
    assert torch.equal(exact, fsm.int8_small_m_gemm(q, w, sa, sb, b, torch.float16, config, dot_fp16=True))


def test_small_m_gemms_refuse_the_other_dtype():
    q, w, sa, sb, _ = int8_inputs(2, 64, 64, False, False, seed=6)
    with pytest.raises(AssertionError):
        fsm.fp8_small_m_gemm(q, w, sa, sb)
    with pytest.raises(AssertionError):
        fsm.int8_small_m_gemm(fp8(q.float()), fp8(w.float()), sa, sb)


@pytest.mark.parametrize("m,route", [(1, "gemv"), (2, "gemv"), (3, "small_m"), (8, "small_m"), (32, "small_m"),
                                     (33, "gemm")])
def test_int8_rows_route(monkeypatch, m, route):
    """w8a8_linear_prequantized on Hopper (the GPU check stubbed): int8_gemv up to Tuning.int8_gemv_max_m rows, the
    small-M GEMM's int8 form up to int8_small_m_max_m, the int8 GEMM above."""
    q, w, sa, sb, _ = int8_inputs(m, 64, 48, False, False, seed=7)
    calls = []
    monkeypatch.setattr(w8a8, "_arch", lambda t: (9, 0))
    monkeypatch.setattr(w8a8.int8_gemv, "int8_gemv", lambda *a: calls.append("gemv"))
    monkeypatch.setattr(w8a8, "int8_small_m_gemm", lambda *a: calls.append("small_m"))
    monkeypatch.setattr(w8a8, "scaled_gemm", lambda *a: calls.append("gemm"))
    w8a8.w8a8_linear_prequantized(q, w, sb, sa, None, torch.bfloat16)
    assert calls == [route]
