"""One request's tokens, KV blocks and outputs, as the scheduler and the runner see it."""
from enum import Enum, auto
from itertools import count

from lowbit.serve.engine.sampling_params import SamplingParams


PENDING = -1  # a sampled token still on the GPU (overlapped steps): its slot in token_ids, filled one step later


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, tokens found by prefix reuse at the last admission
        self.block_tables: list[list[int]] = [[]]  # one per layer kind (BlockManager's pools), all one length
        self.num_hashed_blocks = 0  # leading blocks of the block tables registered for prefix reuse
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.stopping = False  # its last token (by max_tokens) is being computed: schedule it no more
        # logprobs: one entry per token, {token_id: logprob} holding the chosen token and the top-N
        self.prompt_logprobs: list[dict[int, float] | None] = [None] if params.prompt_logprobs is not None else []
        self.logprobs: list[dict[int, float]] = []

    @property
    def block_table(self) -> list[int]:
        """Kind 0's block table (the only one of a model with one layer kind)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than the newest token is still uncomputed (prompt, or the whole history after a preemption)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def block(self, i: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
