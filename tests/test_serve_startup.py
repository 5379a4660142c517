"""`lowbit serve` start-up and security as a user meets them: fast --help, bad port and busy port refused before the
model loads, the API key from the environment or a file (never needed on the command line), /metrics behind it,
401s in OpenAI's shape, and the access log (off with --quiet). Real subprocess servers on the embedded model."""
import json
import socket
import subprocess
import sys
import time

import openai
import pytest
from test_serve_api import http, serve

from lowbit.errors import UserError
from lowbit.models import DEFAULT_MODEL
from lowbit.serve.server.auth import ENV_VAR, api_key_from, bearer_matches

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "modelopt")
ERROR_401 = {"error": {"message": "Incorrect or missing API key", "type": "invalid_request_error", "param": None,
                       "code": "invalid_api_key"}}


def lowbit(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbit.cli", *args], capture_output=True, text=True, timeout=120,
                          **kw)


@pytest.mark.parametrize("argv", [["serve", "--help"], ["--help"]])
def test_help_imports_nothing_heavy(argv):
    code = ("import sys\nfrom lowbit.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in %r if m in sys.modules))" % (argv, HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().splitlines()[-1] == "[]"
    assert "usage:" in out.stdout


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_port_out_of_range_is_one_line():
    assert "--port 99999" in one_error_line(lowbit("serve", DEFAULT_MODEL, "--port", "99999"))


def test_busy_port_fails_fast_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.perf_counter()
        result = lowbit("serve", DEFAULT_MODEL, "--port", str(port))
        elapsed = time.perf_counter() - t0
    line = one_error_line(result)  # one line: so no "[lowbit] loading ..." progress came before it
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert elapsed < 5, elapsed  # loading the model alone takes longer than this on the CPU machine


def test_key_sources(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key_from(None, None, {ENV_VAR: "from-env"}) == "from-env"
    assert api_key_from(None, key_file, {ENV_VAR: "from-env"}) == "from-file"
    assert api_key_from("from-cli", None, {ENV_VAR: "from-env"}) == "from-cli"
    assert api_key_from(None, None, {ENV_VAR: ""}) is None and api_key_from(None, None, {}) is None
    with pytest.raises(UserError, match="not both"):
        api_key_from("a", key_file, {})
    (tmp_path / "empty").write_text("\n")
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(UserError, match="--api-key-file"):
            api_key_from(None, bad, {})
    assert bearer_matches("Bearer from-file", "from-file")
    for wrong in (None, "", "Bearer from-fil", "Bearer from-file2", "bearer from-file", "from-file"):
        assert not bearer_matches(wrong, "from-file")


def test_bad_key_file_is_one_line(tmp_path):
    assert "--api-key-file" in one_error_line(lowbit("serve", DEFAULT_MODEL, "--api-key-file", str(tmp_path / "no")))


def access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("[lowbit] 127.0.0.1:")]


def test_key_from_environment_guards_v1_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "env-secret")
    with serve(DEFAULT_MODEL, tmp_path) as base:
        pid_cmdlines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "env-secret" not in pid_cmdlines  # nothing on any command line shows the key
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="env-secret", max_retries=0)
        out = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=4,
                                        temperature=0)
        assert out.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=f"{base}/v1", api_key="env-secreT", max_retries=0).models.list()
        assert e.value.status_code == 401
        for path, key in [("/v1/models", None), ("/v1/models", "wrong"), ("/metrics", None), ("/metrics", "x")]:
            status, body = http("GET", base + path, key=key)
            assert (status, json.loads(body)) == (401, ERROR_401), (path, key)
        status, body = http("GET", f"{base}/metrics", key="env-secret")
        assert status == 200 and "lowbit_requests_running" in body
        assert http("GET", f"{base}/health")[0] == 200  # liveness probes need no key
        time.sleep(0.2)
        log = (tmp_path / "server.log").read_text()
    lines = access_lines(log)
    completion = [x for x in lines if '"POST /v1/completions" 200' in x]
    assert len(completion) == 1 and completion[0].endswith("prompt_tokens=5 completion_tokens=4"), lines
    assert any('"GET /metrics" 401' in x for x in lines) and any('"GET /v1/models" 401' in x for x in lines)
    assert "[lowbit] loading smollm2-135m ..." in log and "[lowbit] KV cache:" in log  # load progress


def test_key_file_public_metrics_and_quiet(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    (tmp_path / "key").write_text("file-secret\n")
    with serve(DEFAULT_MODEL, tmp_path, "--api-key-file", str(tmp_path / "key"), "--public-metrics",
               "--quiet") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="file-secret", max_retries=0)
        chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens == 3
        assert http("GET", f"{base}/metrics")[0] == 200
        status, body = http("POST", f"{base}/v1/completions", {"model": DEFAULT_MODEL, "prompt": "a"})
        assert (status, json.loads(body)) == (401, ERROR_401)
        log = (tmp_path / "server.log").read_text()
    assert access_lines(log) == [] and "serving smollm2-135m" in log
