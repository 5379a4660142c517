"""What the load benchmarks share: concurrent client threads and the server's /metrics on loopback."""
import http.client
import threading
import time


def get_metrics(host, port, api_key: str | None = None) -> dict[str, float]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    text = conn.getresponse().read().decode()
    conn.close()
    return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def run_clients(clients: int, client) -> float:
    """Runs `client` on that many threads at once until all return; the wall time in seconds."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def metrics_when_idle(host, port, api_key: str | None = None, timeout_s: float = 30) -> dict[str, float]:
    """/metrics once no request is running (aborted requests leave at the engine's next step), or after timeout_s."""
    deadline = time.perf_counter() + timeout_s
    while (m := get_metrics(host, port, api_key))["lowbit_requests_running"] > 0 and time.perf_counter() < deadline:
        time.sleep(0.2)
    return m
