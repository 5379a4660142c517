"""An AutoAWQ GEMM checkpoint (zero points) served on the W4 kernels: every quantized linear is packed as kind "w4"
(not a dense bf16 fallback), and with the kernels run in Triton's CPU interpreter (the GPU's code path, forced on
the CPU) the engine's greedy tokens equal transformers' on the dequantized float model, through every zero-point
route (a 20-token prefill, two decode rows, then one): the GEMV with zero points in the kernel, and with the GEMV
routed off the correction paths (folded into the bias at one row, the in-place launch at two)."""
import contextlib
import functools

import pytest
import torch

pytest.importorskip("triton")

from lowbit.kernels import routes, tuning  # noqa: E402
from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.kernels.linear import qlinear  # noqa: E402
from lowbit.serve.layers import linear as linear_layer  # noqa: E402
from interop_fixtures import int4_checkpoint  # noqa: E402

PROMPTS = [[(7 * i + 3) % 1000 + 5 for i in range(n)] for n in (3, 17)]
NEW_TOKENS = (2, 5)


@pytest.mark.skipif(not interpreting(), reason="needs triton and TRITON_INTERPRET=1 at its import")
@pytest.mark.parametrize("gemv,routes_seen", [
    (True, {"zp_gemv", "zp_addmm"}),
    (False, {"zp_bias", "zp_add", "zp_addmm"}),
])
def test_autoawq_runs_on_w4_kernels_with_transformers_tokens(tmp_path, monkeypatch, gemv, routes_seen):
    from lowbit.serve import LLM, SamplingParams

    _, model = int4_checkpoint(tmp_path, "awq", sym=False)
    expected = []
    for ids, new in zip(PROMPTS, NEW_TOKENS):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        expected.append(gen[0, len(ids):].tolist())
    # the CUDA path on the CPU: pack the kernel layout at load, run the kernels (interpreted) at every call
    monkeypatch.setattr(linear_layer, "prepare_linear", functools.partial(qlinear.prepare_linear, pack=True))
    monkeypatch.setattr(qlinear, "on_gpu", lambda x: True)
    corrections = set()

    def spy(op, *args, **kwargs):
        kernel = real_route(op, *args, **kwargs)
        if op == "zero_point":
            corrections.add(kernel)
        return kernel

    real_route = routes.route
    monkeypatch.setattr(routes, "route", spy)
    llm = LLM(str(tmp_path), num_kv_blocks=32, max_num_tokens=48, dtype="float16")
    prepared = [m.prepared for m in llm.engine.runner.model.modules() if getattr(m, "prepared", None) is not None]
    assert prepared and {(p.algo, p.kind) for p in prepared} == {("W4A16_ZP", "w4")}
    assert all(p.weight.zero_point is not None for p in prepared)
    params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True) for new in NEW_TOKENS]
    with contextlib.nullcontext() if gemv else tuning.override(w4_gemv_max_m=0):
        outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert corrections == routes_seen
