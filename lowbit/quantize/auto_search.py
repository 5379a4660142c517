"""`--recipe auto`'s search: per-unit (KL, bits) of every choice -> mixes of increasing size, smallest first."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    label: str  # a Choice label
    kl: float  # nats/token when this unit alone takes this option
    bits: float  # stored bits per weight


def average_bits(mix: dict, table: dict, params: dict) -> float:
    """Bits per weight over every unit of a mix {unit: label}, weighted by the units' weight counts."""
    total = sum(params.values())
    return sum(table[u][label].bits * params[u] for u, label in mix.items()) / total


def upgrade_path(table: dict, params: dict) -> list[dict]:
    """Mixes from every unit at its smallest option to every unit at its most accurate one.

    table: {unit: {label: Option}}. Each step moves one unit to the option that buys the most KL per added bit
    (KL of single-unit changes treated as additive), so the path is the greedy frontier of size vs summed KL.
    """
    mix = {u: min(opts.values(), key=lambda o: (o.bits, o.kl)).label for u, opts in table.items()}
    path = [dict(mix)]
    while True:
        best, gain = None, 0.0
        for u, opts in table.items():
            cur = opts[mix[u]]
            for o in opts.values():
                if o.kl < cur.kl and o.bits > cur.bits:
                    g = (cur.kl - o.kl) / ((o.bits - cur.bits) * params[u])
                    if g > gain:
                        best, gain = (u, o.label), g
        if best is None:
            return path
        mix[best[0]] = best[1]
        path.append(dict(mix))


def trials(path: list[dict], table: dict, params: dict, max_bits: float, count: int) -> list[dict]:
    """Up to `count` mixes of the path within max_bits average bits, spread evenly from the smallest to the largest
    that fits (both included), smallest first. Empty when even the smallest exceeds max_bits."""
    fits = [m for m in path if average_bits(m, table, params) <= max_bits + 1e-9]
    if len(fits) <= count:
        return fits
    picks = sorted({round(i * (len(fits) - 1) / (count - 1)) for i in range(count)}) if count > 1 else [len(fits) - 1]
    return [fits[i] for i in picks]
