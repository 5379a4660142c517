"""/metrics of data-parallel replicas as one: each sample summed over the replicas (counters, gauges, histogram
buckets), ratios (`*_rate`, `*_mean`) averaged, and per-replica gauges labelled `replica`."""
from collections import defaultdict

RATIO_SUFFIXES = ("_rate", "_mean")  # a sum of ratios means nothing; their mean over the replicas is shown


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def merge(texts: list[str | None], load: list[int], routed: list[int], kv_used: list[int | None]) -> str:
    """texts: each replica's Prometheus text (None: dead, not scraped); load / routed / kv_used: per replica."""
    order: list[str] = []  # comment lines and sample keys, in the order first seen
    sums: dict[str, float] = defaultdict(float)
    seen: dict[str, int] = defaultdict(int)
    for text in texts:
        for line in (text or "").splitlines():
            if line.startswith("#") or not line.strip():
                if line not in seen:
                    order.append(line)
                    seen[line] = 0
                continue
            key, value = line.rsplit(" ", 1)
            if key not in seen:
                order.append(key)
            sums[key] += float(value)
            seen[key] += 1
    lines = []
    for item in order:
        if item.startswith("#") or not item.strip():
            lines.append(item)
            continue
        name = item.split("{", 1)[0]
        value = sums[item] / seen[item] if name.endswith(RATIO_SUFFIXES) else sums[item]
        lines.append(f"{item} {_number(value)}")
    per_replica = {
        "lowbit_replica_up": ("gauge", "1 while the data-parallel replica's process serves, 0 once it died.",
                              [int(t is not None) for t in texts]),
        "lowbit_replica_requests": ("gauge", "Requests on the replica (running + waiting).", load),
        "lowbit_replica_requests_total": ("counter", "Requests routed to the replica.", routed),
        "lowbit_replica_kv_blocks_used": ("gauge", "KV cache blocks in use on the replica.", kv_used),
    }
    for name, (kind, help_text, values) in per_replica.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{replica="{i}"}} {v}' for i, v in enumerate(values) if v is not None]
    return "\n".join(lines) + "\n"
