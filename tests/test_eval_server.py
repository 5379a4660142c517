"""The server backend (lm-eval local-completions against `lowbit serve`) agrees with the in-process backend."""
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lowbit.evaluate.harness import inproc_lm, run_task, server_lm

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(embedded_model_dir):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lowbit.cli", "serve", "smollm2-135m", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"lowbit serve did not come up: {proc.stdout.read()[-2000:]}")
            time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def both(server_url, embedded_model_dir):
    from lowbit.checkpoint import load_reference_model

    model, tokenizer = load_reference_model(embedded_model_dir)
    return inproc_lm(model, tokenizer), server_lm(server_url, "smollm2-135m", str(embedded_model_dir))


def test_loglikelihoods_agree(both):
    from lm_eval.api.instance import Instance

    pairs = [("Question: Which is a liquid?\nAnswer:", " water"), ("Question: Which is a liquid?\nAnswer:", " rock"),
             ("The capital of France is", " Paris, a city on the Seine")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    local, served = (lm.loglikelihood(requests) for lm in both)
    for (lp, greedy), (lp_ref, greedy_ref) in zip(served, local):
        assert abs(lp - lp_ref) < 1e-3 and greedy == greedy_ref


def test_task_scores_agree(both):
    local, served = (run_task(lm, "arc_easy", limit=5) for lm in both)
    assert served["per_doc"] == local["per_doc"]


def test_gate_through_server_against_itself(server_url, tmp_path, monkeypatch, capsys):
    """The embedded model served, gated against itself in process: ratio 1, recovery 1, exit 0."""
    import json

    from lowbit import cli
    from lowbit.evaluate import cache

    monkeypatch.setattr(cache, "cache_dir", lambda: tmp_path / "eval-cache")
    monkeypatch.setattr(sys, "argv", ["lowbit", "eval"])  # lowbit.cli picks the subcommand module from sys.argv
    report = tmp_path / "r.json"
    argv = ["eval", "smollm2-135m", "--baseline", "smollm2-135m", "--backend", "server", "--url", server_url,
            "--tasks", "arc_easy,ppl", "--limit", "4", "--ppl-seqs", "1", "--gate", "recovery>=0.999,ppl_ratio<=1.001",
            "--report", str(report)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    result = json.loads(report.read_text())
    assert result["tasks"]["arc_easy"]["recovery"][0] == 1.0
    assert abs(result["summary"]["ppl_ratio"][0] - 1) < 1e-4 and result["text"]["kl"] is None
    assert cli.main(argv[:-4] + ["--gate", "kl<=0.01"]) == 2  # KL needs full distributions
