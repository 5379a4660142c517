"""The engine on dummy weights with the Triton attention backend vs the torch reference backend.

CPU: the Triton interpreter on a tiny fp32 model (attention kernels only; linears run their references).
GPU: lowbit.bench.serve_bench's check (all kernels + CUDA graphs vs the reference path) on 2 layers of Llama-8B widths.
"""
import pytest
import torch

pytest.importorskip("triton")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from lowbit.kernels._triton import interpreting  # noqa: E402
from lowbit.serve.layers import attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev" / "bench"))  # the lab scripts' loader
from lab import load_script  # noqa: E402


def load_bench():
    from lowbit.bench import serve_bench
    return serve_bench


@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="CPU interpreter test")
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_triton_attention_backend_matches_torch_backend_on_cpu(fmt):
    from lowbit.serve.layers.triton_attention import TritonAttentionBackend

    bench = load_bench()
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, fmt, enable_prefix_caching=False, max_batch_size=4, max_num_tokens=40,
                                num_kv_blocks=64)
    prompts = [bench.random_prompts(1, n, 512, seed=n)[0] for n in (3, 21, 50)]  # 50 > max_num_tokens: chunked
    saved = attention._backend
    try:
        attention.set_attention_backend(TritonAttentionBackend())
        tok_t, logits_t, _ = bench.greedy_with_logits(engine, prompts, 6)
    finally:
        attention.set_attention_backend(saved)
    tok_r, logits_r, _ = bench.greedy_with_logits(engine, prompts, 6)
    assert tok_t == tok_r
    tol = 2e-2 if fmt == "fp8" else 1e-4  # the interpreter mis-rounds ~2 % of fp32->fp8 casts in the KV store
    for a, b in zip(logits_t, logits_r):
        assert ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4_awq", "nvfp4", "w8a8_sq"])
def test_kernels_and_graphs_match_reference_path_on_gpu(fmt):
    bench = load_bench()
    res = bench.check_format(bench.parse(["--check-layers", "2"]), fmt)
    assert res["graph_used"] and res["pass"], res


def test_measured_runs_meet_no_cached_prefix():
    """Two maximum-load runs of the same shape in one process (as serve_bench's extras) take the same number of
    steps: the second must not skip prefill by hitting the first run's blocks in the prefix cache (it did when both
    drew their prompts from one seed: 512 x 1000/1000 then 768 x 1000/1000 ran 64 fewer steps, benchmarks.md run 31)."""
    bench = load_bench()
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, "bf16", max_batch_size=8, max_num_tokens=64, num_kv_blocks=256)
    vocab = engine.runner.model.config["vocab_size"]
    first = bench.offline(engine, bench.fresh_prompts(4, 48, vocab), 2)
    second = bench.offline(engine, bench.fresh_prompts(4, 48, vocab), 2)
    assert second["steps"] == first["steps"] >= 4  # 4 x 48 prompt tokens at 64 per step, then the decode
    repeated = bench.offline(engine, bench.random_prompts(4, 48, vocab, seed=1), 2)
    repeated_again = bench.offline(engine, bench.random_prompts(4, 48, vocab, seed=1), 2)
    assert repeated_again["steps"] < repeated["steps"]  # what a repeated seed does: the cache serves the prefill


@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="CPU interpreter test")
def test_reference_path_swaps_in_references_and_restores_on_cpu():
    """serve_bench's reference path (the GPU check's baseline) runs the engine on the torch references and then puts
    every kernel back; it broke once when a layers function it swaps was removed."""
    from lowbit.serve.layers import ops as layers

    bench = load_bench()
    args = bench.parse(["--tiny", "--device", "cpu"])
    engine = bench.build_engine(args, "fp8", enable_prefix_caching=False, max_batch_size=4, num_kv_blocks=64)
    before = {n: getattr(layers, n) for n in bench.LAYER_OPS}
    backend = attention._backend
    with bench.reference_path(engine):
        assert all(getattr(layers, n) is not before[n] for n in before) and attention._backend is not backend
        tokens, _, _ = bench.greedy_with_logits(engine, [bench.random_prompts(1, 9, 512, seed=9)[0]], 3)
    assert len(tokens[0]) == 3
    assert {n: getattr(layers, n) for n in before} == before and attention._backend is backend


def _kernel_imports(module) -> set[str]:
    import ast
    import inspect

    return {a.asname or a.name for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.ImportFrom) and node.module == "lowbit.kernels" for a in node.names}


def test_reference_path_swaps_every_kernel_op_the_layers_import():
    """The layers and models call their per-step kernel ops through layers.ops, whose names the reference path swaps;
    an op imported anywhere else (the attention backends aside: the reference path swaps a backend whole) would run
    in the GPU check's baseline."""
    import importlib
    import pkgutil

    import lowbit.serve.layers
    import lowbit.serve.models
    from lowbit.serve.layers import ops

    assert _kernel_imports(ops) == set(load_bench().LAYER_OPS)
    for pkg in (lowbit.serve.layers, lowbit.serve.models):
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name not in ("ops", "attention", "triton_attention"):
                module = importlib.import_module(f"{pkg.__name__}.{info.name}")
                assert _kernel_imports(module) <= {"prepare_linear"}, module.__name__


def test_cpu_engine_installs_the_torch_attention_backend():
    """The attention backend is process-wide: a CPU engine built after a GPU engine (whose build installs the Triton
    kernels) must put the torch backend back, or its steps would hand CPU tensors to GPU kernels."""
    bench = load_bench()
    saved = attention._backend
    try:
        attention.set_attention_backend(object())  # stands for a GPU engine's backend
        bench.build_engine(bench.parse(["--tiny", "--device", "cpu"]), "bf16", max_batch_size=2, num_kv_blocks=16)
        assert isinstance(attention._backend, attention.TorchAttentionBackend)
    finally:
        attention.set_attention_backend(saved)


def test_kernel_profile_mixed_step_prompts_match_the_prompts_alone():
    """dev/bench/kernel_profile.py's mixed step (decodes first, then whole prompts, as the scheduler orders them): the
    prompts' logits equal those of the same prompts in a prefill-only step, so the step's positions, slots and
    query offsets are the engine's."""
    kp, bench = load_script("kernel_profile.py"), load_bench()
    engine = bench.build_engine(bench.parse(["--tiny", "--device", "cpu"]), "bf16", max_batch_size=8,
                                max_num_tokens=128, num_kv_blocks=256)
    model = engine.runner.model
    ids, ctx = kp.mixed_inputs(engine, 3, 40, 64, 32)
    assert ctx.query_lens_cpu == [1, 1, 1, 32, 32] and ctx.context_lens_cpu == [40, 40, 40, 32, 32]
    assert len(set(ctx.slot_mapping.tolist())) == len(ids)  # every new token's K/V has its own slot
    _, alone_ctx = kp.prefill_inputs(engine, 2, 32)
    with torch.inference_mode():
        mixed = model.compute_logits(model(ids, ctx)[ctx.logits_indices])[3:]
        alone = model.compute_logits(model(ids[3:], alone_ctx)[alone_ctx.logits_indices])
    torch.testing.assert_close(mixed, alone, rtol=1e-4, atol=1e-4)


def test_step_profile_lists_slow_steps_with_their_batches():
    """dev/bench/step_profile.py --slow-ms: every step over the bar is listed with what it scheduled; on the tiny CPU
    engine (a bar of 0 ms lists them all) the listed prompt chunks add up to every prompt token, decodes first."""
    import re

    sp, bench = load_script("step_profile.py"), load_bench()
    engine = bench.build_engine(bench.parse(["--tiny", "--device", "cpu"]), "bf16", max_batch_size=8,
                                max_num_tokens=64, num_kv_blocks=256)
    res = sp.run(engine, 6, 48, 3, seed=1, slow_ms=1e-9)
    assert [row["step"] for row in res["slow_steps"]] == list(range(res["steps"]))
    parts = [re.fullmatch(r"(\d+) decodes \+ (\d+) prompt chunks \((\d+) tokens, longest (\d+)\)", row["this"])
             for row in res["slow_steps"]]
    assert parts[0].groups() == ("0", "2", "64", "48")  # 64-token budget: one whole prompt and 16 of the next
    assert sum(int(m.group(3)) for m in parts) == 6 * 48
    assert all(row["before"] == prev["this"] for prev, row in zip(res["slow_steps"], res["slow_steps"][1:]))


def test_bench_list_flags_take_positive_ints_or_exit_2(capsys):
    """The benchmarks' list flags (bench_cli.int_list / int_pairs / gemv_configs): the parsed values, or one usage
    line and exit 2."""
    import argparse

    from lowbit.bench_cli import gemv_configs, int_list, int_pairs

    p = argparse.ArgumentParser(prog="bench")
    assert int_list(p, "--m", "1,16,4096") == [1, 16, 4096]
    assert int_pairs(p, "--decode", "1x512,256x200") == [(1, 512), (256, 200)]
    assert gemv_configs(p, "--configs", "8,2048,4; 4,1024,2;") == [(8, 2048, 4), (4, 1024, 2)]
    assert gemv_configs(p, "--configs", "") == []
    for parse, text in ((int_list, "1,x"), (int_list, "0"), (int_pairs, "2x3x4"), (int_pairs, "2x-3"),
                        (gemv_configs, "8,2048"), (gemv_configs, "8,2048,0"), (gemv_configs, "8x2048x4")):
        with pytest.raises(SystemExit) as e:
            parse(p, "--flag", text)
        assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith("bench: error: --flag")


def test_bench_json_lines_rounds_prints_and_appends(tmp_path, capsys):
    """bench_cli.json_lines: each record rounded (2 decimals from 1 up, 3 significant digits below), printed as a JSON
    line and appended to the file as it comes; a file from an earlier run is emptied first."""
    import json

    from lowbit.bench_cli import json_lines

    path = tmp_path / "run.jsonl"
    path.write_text('{"stale": 1}\n')
    emit, lines = json_lines(path)
    emit({"us": 12.3456, "err": 0.000123456, "M": 64})
    assert lines == [{"us": 12.35, "err": 0.000123, "M": 64}]
    assert path.read_text().splitlines() == [json.dumps(lines[0])]
    emit({"kind": "time"})
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines
    assert capsys.readouterr().out.splitlines() == [json.dumps(d) for d in lines]


@pytest.mark.parametrize("script,argv,message", [
    ("w4_mid_m_bench.py", ["--m", "32,64", "--sweep", "48"], "--sweep 48: every M swept must be one of --m 32,64"),
    ("w4_mid_m_bench.py", ["--reps", "0"], "--reps 0: must be at least 1"),
    ("ncu_targets.py", ["w4tc", "--rows", "0"], "--rows 0: must be at least 1"),
])
def test_w4_benches_refuse_bad_flags_with_exit_2(capsys, script, argv, message):
    """The W4 mid-M bench and the ncu target answer bad flags with one usage line and exit 2, before any GPU work."""
    with pytest.raises(SystemExit) as e:
        load_script(script).main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_step_profile_device_gaps():
    """dev/bench/step_profile.py --trace: the device's idle time between overlapping kernels and copies (ms from us)."""
    sp = load_script("step_profile.py")
    res = sp.device_gaps([(0, 100, "a"), (50, 400, "b"), (300, 350, "c"), (1400, 1500, "d"), (1450, 1600, "e"),
                          (1700, 1800, "f")])
    assert res["span_ms"] == 1.8 and res["busy_ms"] == 0.7 and res["idle_ms"] == 1.1 and res["gaps"] == 2
    assert res["longest"] == [(1.0, "b", "d"), (0.1, "e", "f")]


def test_gpu_fp8_cache_refuses_block_size_not_a_power_of_two(monkeypatch):
    """An engine with the GPU kernels and an FP8 KV cache stops at start on a block size whose V blocks the kernels
    cannot read (the Triton backend stubbed in on the CPU: the check comes before anything runs)."""
    from lowbit.serve.runner import model_runner

    bench = load_bench()
    monkeypatch.setattr(model_runner, "_use_gpu_attention", lambda on_cuda: True)
    with pytest.raises(ValueError, match="block_size 24: an FP8 KV cache on the GPU needs a power of two"):
        bench.build_engine(bench.parse(["--tiny", "--device", "cpu"]), "fp8", block_size=24, num_kv_blocks=64)


def test_step_profile_lists_kernel_variants_built_mid_run():
    """dev/bench/step_profile.py --compiles: Triton's pre-compile hook records [step, kernel] while the run lasts and is
    put back afterwards. The tiny CPU engine builds no compiled kernel (the interpreter): an empty list."""
    from types import SimpleNamespace

    triton = pytest.importorskip("triton")
    sp, bench = load_script("step_profile.py"), load_bench()
    engine = bench.build_engine(bench.parse(["--tiny", "--device", "cpu"]), "bf16", max_batch_size=4,
                                max_num_tokens=64, num_kv_blocks=64)
    before = triton.knobs.runtime.jit_cache_hook
    assert sp.run(engine, 2, 8, 2, seed=1, compiles=True)["compiled"] == []
    assert triton.knobs.runtime.jit_cache_hook is before
    step_no, compiled = [7], []
    unwatch = sp.watch_compiles(step_no, compiled)
    try:
        hook = triton.knobs.runtime.jit_cache_hook
        assert hook(key=None, repr="", fn=SimpleNamespace(name="_decode_kernel"), compile={},
                    is_manual_warmup=False, already_compiled=False) is None  # None: compile as usual
    finally:
        unwatch()
    assert triton.knobs.runtime.jit_cache_hook is before
    assert compiled == [[7, "_decode_kernel"]]


def test_static_int8_reference_is_fp32_math_on_the_codes():
    """serve_bench's reference path computes a static INT8 (w8a8_sq) linear as the kernels do: int8 codes of the
    smoothed x (act_quant_ref), exact products, the scales once (the GPU check's baseline); linear_ref (the checkpoint
    reader's convention) rounds the dequantized x to bf16 first, so the two differ by about that rounding only."""
    from lowbit.kernels import linear_ref
    from lowbit.kernels.linear.act_quant import act_quant_ref
    from lowbit.kernels.linear.qlinear import prepare_linear
    from lowbit.testing.synthetic import quantize_linear

    bench = load_bench()
    g = torch.Generator().manual_seed(3)
    smooth = (0.5 + torch.rand(256, generator=g)).to(torch.bfloat16)
    p = prepare_linear("W8A8_SQ_PER_CHANNEL", quantize_linear("W8A8_SQ_PER_CHANNEL", torch.randn(64, 256, generator=g)
                                                             * 0.02, smooth=smooth), "cpu")
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    out = bench.int8_linear_fp32(x, p, None, torch.float32)
    codes, _ = act_quant_ref(x, torch.int8, p.input_scale, p.smooth)
    exact = (codes.double() @ p.source["weight"].double().t()) * p.input_scale.double() \
        * p.source["weight_scale"].double()
    assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-6
    reader = linear_ref(x, p, None, torch.float32)
    assert 0 < ((reader - out).norm() / out.norm()).item() < 1e-2


def test_markdown_gives_every_format_its_ratio_to_hf():
    """serve_bench's report: each format that ran HF's batch-64 workload gets its tok/s and its ratio to HF's."""
    bench = load_bench()
    serve = dict(weight_gib=1.0, kv_tokens=16, batch1=dict(decode_tok_s=1, ttft_ms=1, itl_ms_median=1),
                 max_load=dict(output_tok_s=1, requests=1, isl=1, osl=1))
    r = {"date": "d", "gpu": "g", "torch": "t", "model": "m", "command": "c",
         "hf": {"transformers": "5", "batch": 64, "isl": 128, "osl": 128, "output_tok_s": 700.0},
         "serve_bf16": dict(serve, format="bf16", hf_workload={"output_tok_s": 9100.0, "ratio_vs_hf": 13.0}),
         "serve_fp8": dict(serve, format="fp8", hf_workload={"output_tok_s": 11200.0, "ratio_vs_hf": 16.0}),
         "serve_nvfp4": dict(serve, format="nvfp4")}  # no HF workload: not listed
    line = [s for s in bench.markdown(r).splitlines() if s.startswith("HF transformers")]
    assert len(line) == 1 and "bf16 9100.0 tok/s (**13.0x**)" in line[0] and "fp8 11200.0 tok/s (**16.0x**)" in line[0]
    assert "nvfp4" not in line[0]
