"""Engine settings: a few knobs, with the defaults a user gets from `lowbit serve NAME`."""
import re
from dataclasses import dataclass, fields


# the most tokens drafted per sequence and step by default: n-gram drafts cost nothing to make and a verify step costs
# about the same for k = 1..8 at small batches (docs/performance.md); a draft model runs a forward per drafted token
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 8, "draft": 4}


@dataclass
class EngineConfig:
    max_batch_size: int = 64  # sequences in flight
    max_num_tokens: int = 2048  # tokens computed per step (prefill chunks + decodes)
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped by the KV pool
    kv_cache_fraction: float | None = None  # of free memory (GPU, after weights; default 0.9) or of available RAM (CPU; default 0.05)
    num_kv_blocks: int | None = None  # an exact pool size (pools per layer kind: that many blocks' bytes); overrides kv_cache_fraction
    kv_cache_max_tokens: int | None = None  # caps the pool sized by kv_cache_fraction (TensorRT-LLM's max_tokens)
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (GPU only)
    block_size: int = 16
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto: the checkpoint's; or float32 / bfloat16 / float16
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0  # seeds requests that give no seed of their own
    overlap_steps: bool | None = None  # host prepares step n+1 while the device runs step n (default: on GPU)
    host_cache_size: int | str = 0  # bytes of host memory for evicted prefix blocks (0: off); "4GiB" works too
    speculative: str | None = None  # drafter: "ngram" (prompt lookup) or "draft" (draft_model); None: off
    num_draft_tokens: int | None = None  # the most tokens drafted per sequence and step (k); None: by drafter, above
    ngram_size: int = 3  # ngram: the longest suffix looked up in the sequence's history
    draft_model: str | None = None  # draft: store name or directory of a model with the target's vocabulary
    speculative_max_batch_size: int = 16  # speculation turns itself off for larger decode batches
    speculative_adaptive: bool = True  # below that: speculate only where it measurably beats plain decoding
    tensor_parallel_size: int = 1  # ranks (processes, one GPU each) the model is split over; > 1: no overlap, no graphs
    data_parallel_size: int = 1  # replicas behind one server (lowbit serve), a process each on its own devices

    def __post_init__(self):
        positive = ["max_batch_size", "max_num_tokens", "block_size", "tensor_parallel_size", "data_parallel_size"]
        for name in positive + ["max_model_len", "num_kv_blocks", "kv_cache_max_tokens"]:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in ("overlap_steps", "cuda_graphs", "enable_prefix_caching", "speculative_adaptive"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value is None and name == "overlap_steps"):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.tensor_parallel_size > 1 and self.overlap_steps:
            raise ValueError("overlap_steps is not supported with tensor_parallel_size > 1")
        self.host_cache_size = parse_bytes("host_cache_size", self.host_cache_size)
        self._check_speculative()
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")

    def _check_speculative(self) -> None:
        if self.speculative not in (None, "ngram", "draft"):
            raise ValueError(f"speculative must be ngram, draft or none, got {self.speculative!r}")
        if self.num_draft_tokens is None:
            self.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS.get(self.speculative, 4)
        for name in ("num_draft_tokens", "ngram_size", "speculative_max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative: draft needs draft_model (a store name or checkpoint directory)")
        if self.speculative == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("speculative: draft is not supported with tensor_parallel_size > 1")
        if self.draft_model and self.speculative != "draft":
            raise ValueError(f"draft_model {self.draft_model!r} is set but speculative is {self.speculative!r}, "
                             f"not 'draft'")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine settings {unknown}; known: {sorted(known)}")
        return cls(**values)


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name: str, value) -> int:
    """A byte count from an int or a string such as '4GiB', '512MiB', '2G' (decimal: k, M, G, T; binary: KiB ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be a number of bytes (e.g. 4GiB), got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if unit not in _BYTE_UNITS:
            raise ValueError(f"{name} {value!r}: expected bytes, e.g. 4GiB, 512MiB, 2G or 1000000")
        value = int(float(m.group(1)) * _BYTE_UNITS[unit])
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
