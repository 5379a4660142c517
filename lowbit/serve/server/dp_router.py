"""Which data-parallel replica takes a request: the least loaded, unless the replica that took the same leading
prompt block is within a few requests of it (its prefix cache then holds that block). Torch-free."""
import threading
from collections import OrderedDict

# How many more requests than the least-loaded replica the prompt's home replica may hold and still take it: a
# prefix hit saves that replica a prefill, a longer queue costs the request more than that.
AFFINITY_SLACK = 4
AFFINITY_MEMORY = 65536  # leading-block keys remembered (least recently used forgotten first)


def prefix_key(prompt, block_size: int) -> int | None:
    """A key of the prompt's first full KV block, or None when there is none to reuse (shorter prompts, or a text
    prompt the replica tokenizes itself). The block of the last prompt token is never reused: one token more."""
    if isinstance(prompt, str) or len(prompt) <= block_size:
        return None
    return hash(tuple(prompt[:block_size]))


class Router:
    """load[i]: requests routed to replica i and not yet finished (its running + waiting). Thread-safe."""

    def __init__(self, num_replicas: int, block_size: int, slack: int = AFFINITY_SLACK,
                 memory: int = AFFINITY_MEMORY):
        self.load = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests ever routed to each replica
        self.alive = [True] * num_replicas
        self.block_size, self.slack, self.memory = block_size, slack, memory
        self._home: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica that last took it
        self._lock = threading.Lock()

    def pick(self, prompt) -> int | None:
        """The replica for a new request (counted in its load); None when every replica is dead."""
        with self._lock:
            alive = [i for i, up in enumerate(self.alive) if up]
            if not alive:
                return None
            chosen = min(alive, key=lambda i: (self.load[i], i))
            key = prefix_key(prompt, self.block_size)
            if key is not None:
                home = self._home.get(key)
                if home is not None and self.alive[home] and self.load[home] <= self.load[chosen] + self.slack:
                    chosen = home
                self._home[key] = chosen
                self._home.move_to_end(key)
                if len(self._home) > self.memory:
                    self._home.popitem(last=False)
            self.load[chosen] += 1
            self.routed[chosen] += 1
            return chosen

    def done(self, replica: int) -> None:
        """A request of `replica` finished, was aborted or refused."""
        with self._lock:
            self.load[replica] -= 1

    def dead(self, replica: int) -> None:
        with self._lock:
            self.alive[replica] = False
