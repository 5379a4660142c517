"""`lowbit bench serve-prefix --tiny` on the CPU: it prints command, machine and date, and with the host cache on the
evicted prefix comes back from the host (every prefix token a host hit) with the same first tokens as recomputed."""
import json

from lowbit.bench_cli import load


def test_serve_prefix_tiny_restores_the_prefix_and_agrees(tmp_path, capsys):
    out = tmp_path / "prefix.jsonl"
    argv = ["--tiny", "--device", "cpu", "--prefix-len", "64", "--suffix-len", "5", "--traffic-len", "48",
            "--max-num-tokens", "128", "--repeats", "1", "--json", str(out)]
    assert load("serve-prefix").main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("command: lowbit bench serve-prefix --tiny") and "\nmachine: cpu" in printed
    assert "\ndate: " in printed
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert r["host_hit_tokens"] == 64 and r["restored_blocks"] == 2 * 64 // 16  # warm-up round and the measured one
    assert r["same_first_tokens"] == "1/1"
    assert min(r[k] for k in ("ttft_ms_cold", "ttft_ms_device_hit", "ttft_ms_evicted_host_off",
                              "ttft_ms_evicted_host_on")) > 0
    assert "| 64 + 5 tokens, fp8 |" in printed
