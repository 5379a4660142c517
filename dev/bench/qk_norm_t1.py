"""The fused q/k-norm + rotary + KV-store kernel against its reference at Qwen3-30B-A3B's attention shapes (32 q heads,
4 KV heads, head_dim 128, bf16, bf16 and FP8 caches), 1, 2 and 7 rows, eager and replayed from a CUDA graph: the
largest |q - q_ref| and cache difference per case (GPU).

    python3 dev/bench/qk_norm_t1.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lowbit.kernels.attention.rotary_kv import rotary_store_kv, rotary_store_kv_ref  # noqa: E402

HQ, HK, D, BS, BLOCKS = 32, 4, 128, 16, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, eager only


def case(t: int, kv_dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(t, (HQ + 2 * HK) * D, generator=g)).bfloat16()
    pos = torch.randint(0, 4000, (t,), generator=g)
    inv = 1e6 ** (-torch.arange(0, D, 2) / D)
    freqs = torch.arange(4096.0)[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    cache = torch.zeros(2, BLOCKS, BS, HK, D).to(kv_dtype)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:t]
    norm = ((1 + 0.3 * torch.randn(D, generator=g)).bfloat16().to(DEV), (1 + 0.3 * torch.randn(D, generator=g))
            .bfloat16().to(DEV), 1e-6)
    one = torch.tensor(0.05 if kv_dtype == torch.float8_e4m3fn else 1.0)
    return [x.to(DEV) for x in (qkv, pos, cos_sin, cache, slots, one, one)], norm


def main() -> int:
    worst = 0.0
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for t in (1, 2, 7):
            (qkv, pos, cs, cache, slots, ks, vs), norm = case(t, kv_dtype, t)
            ref_cache = cache.clone()
            q_ref = rotary_store_kv_ref(qkv, HQ, HK, pos, cs, None, ref_cache, slots, ks, vs, qk_norm=norm)
            eager_cache = cache.clone()
            q = rotary_store_kv(qkv, HQ, HK, pos, cs, None, eager_cache, slots, ks, vs, qk_norm=norm)
            runs = [("eager", q, eager_cache)]
            if DEV == "cuda":
                runs.append(graph_run(qkv, pos, cs, cache, slots, ks, vs, norm))
            for label, qq, cc in runs:
                dq = (qq.float() - q_ref.float()).abs().max().item()
                dc = (cc.float() - ref_cache.float()).abs().max().item()
                rel = ((qq.float() - q_ref.float()).norm() / q_ref.float().norm()).item()
                worst = max(worst, rel)
                print(f"{str(kv_dtype):22s} t={t} {label}: max|q-q_ref| {dq:.3g} rel {rel:.2e}  max|cache-ref| {dc:.3g}")
    print(f"worst rel {worst:.2e}")
    return 0 if worst < 1e-2 else 1


def graph_run(qkv, pos, cs, cache, slots, ks, vs, norm):
    graph_cache = cache.clone()
    rotary_store_kv(qkv, HQ, HK, pos, cs, None, graph_cache, slots, ks, vs, qk_norm=norm)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph = rotary_store_kv(qkv, HQ, HK, pos, cs, None, graph_cache, slots, ks, vs, qk_norm=norm)
    graph_cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return "graph", q_graph, graph_cache


if __name__ == "__main__":
    sys.exit(main())
