"""(GPU) The verify step replayed from CUDA graphs on a tiny bf16 model: its logits equal the eager verify step's on
the same inputs, and greedy outputs with n-gram or draft-model speculation equal plain decoding's (up to near ties:
the verify forward's row count differs from the decode step's, so bf16 rounding may flip a near tie)."""
import pytest
import torch

from lowbit.bench.serve_bench import TINY, DummyTokenizer
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.testing.dummy_weights import dummy_checkpoint
from test_serve_spec import generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODEL = dict(TINY, dtype="bfloat16")
# a repeated pattern, a cycle, random-looking text: drafts accepted on some rows, rejected on others
PROMPTS = [[5, 6, 7, 8, 9] * 12, [100 + i % 7 for i in range(50)], [(37 * i) % 500 for i in range(40)],
           [40, 41, 42, 40, 41] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 5]
GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=2)
TIE = 0.05  # top-2 logprob margin below which a greedy choice counts as a near tie
# graphed vs eager verify, ||graphed - eager|| / ||eager|| per step: the same kernels on bf16 activations, but the
# graph's GEMMs see the padded row count, so their tiles (and roundings) may differ; serve_bench's kernels-vs-fp32
# bar is 3e-2
LOGIT_REL_TOL = 1e-2
MARGIN = 0.1  # logit units: rows whose eager top-2 gap is wider pick the same token in both


def engine(draft_seed: int | None = None, **config) -> Engine:
    """Tiny bf16 Llama on the GPU with CUDA graphs; draft_seed: a draft model of the same shapes and vocabulary
    (seed 0: the target's own weights)."""
    ckpt = dummy_checkpoint("bf16", MODEL, device="cuda", std=0.05)
    cfg = dict(max_batch_size=8, num_kv_blocks=256, device="cuda", dtype="bfloat16", cuda_graphs=True,
               speculative_max_batch_size=8) | config
    draft = None
    if draft_seed is not None:
        draft = dummy_checkpoint("bf16", MODEL, seed=draft_seed, device="cuda", std=0.05)
        cfg |= dict(speculative="draft", speculative_adaptive=False, draft_model=f"tiny-seed{draft_seed}")
    return Engine(ckpt.path, EngineConfig(**cfg), ckpt=ckpt, tokenizer=DummyTokenizer(), draft_ckpt=draft)


def record_graph_runs(runner, eager: bool = True) -> list:
    """[(graphed logits, eager logits or None)] per verify-graph replay of runner; eager: the eager forward run
    after it on the same inputs (it rewrites the same K/V into the same slots, in its own rounding)."""
    graphs, pairs = runner.verify_graphs, []
    assert graphs is not None
    run = graphs.run

    def checked(host, upload, pending):
        out = run(host, upload, pending)
        if not eager:
            pairs.append((out, None))
            return out
        out = out.clone()
        runner.verify_graphs = None
        try:
            pairs.append((out, runner.run_host(host, pending)))
        finally:
            runner.verify_graphs = graphs
        return out
    graphs.run = checked
    return pairs


def assert_greedy_same(plain, spec):
    """Token for token, or diverging first where plain decoding's top-2 margin is a near tie."""
    for i, ((ids_a, _, _, lp_a), (ids_b, _, _, _)) in enumerate(zip(plain, spec)):
        n = next((j for j, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        if n is None:
            assert ids_a == ids_b
            continue
        (_, first), (_, second) = sorted(lp_a[n][1], key=lambda e: -e[1])[:2]
        assert first - second < TIE, f"prompt {i} diverged at token {n}, top-2 margin {first - second:.3f}"


def test_graphed_verify_logits_equal_eager_verify_logits():
    e = engine(speculative="ngram", speculative_adaptive=False,
               num_draft_tokens=4, ngram_size=1)  # one-token matches: drafts often
    assert e.runner.verify_graphs is not None and e.runner.verify_graphs.tokens == [2, 3, 4, 5]
    pairs = record_graph_runs(e.runner)
    generate(e, PROMPTS, GREEDY)
    assert e.spec.num_steps > 0 and e.spec.num_accepted > 0 and len(pairs) >= e.spec.num_steps
    for graphed, eager in pairs:
        assert graphed.shape == eager.shape
        assert ((graphed - eager).norm() / eager.norm()).item() < LOGIT_REL_TOL
        top2 = eager.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > MARGIN
        assert torch.equal(graphed.argmax(-1)[clear], eager.argmax(-1)[clear])


@pytest.mark.parametrize("drafter", ["ngram", "draft-self", "draft-other"])
def test_greedy_outputs_with_graphed_speculation_equal_plain_decoding(drafter):
    plain = generate(engine(), PROMPTS, GREEDY)
    draft_replays = [0]
    if drafter == "ngram":
        e = engine(speculative="ngram", speculative_adaptive=False,
                   num_draft_tokens=4, ngram_size=1)  # one-token matches: drafts often
    else:
        e = engine(draft_seed=0 if drafter == "draft-self" else 1, num_draft_tokens=4)
        draft_graphs = e.spec.drafter.runner.graphs
        assert draft_graphs is not None and e.spec.drafter.runner.verify_graphs is not None
        run = draft_graphs.run

        def counting(*args):
            draft_replays[0] += 1
            return run(*args)
        draft_graphs.run = counting
    pairs = record_graph_runs(e.runner, eager=False)
    spec = generate(e, PROMPTS, GREEDY)
    assert_greedy_same(plain, spec)
    assert e.spec.num_steps > 0 and len(pairs) >= e.spec.num_steps  # every verify step replayed a graph
    if drafter != "ngram":  # the k - 1 one-token draft steps replay the draft model's decode graphs
        assert draft_replays[0] >= e.spec.num_steps
    if drafter == "draft-self":
        assert e.spec.num_accepted > 0.5 * e.spec.num_drafted
    assert e.block_manager.num_used_blocks == 0
