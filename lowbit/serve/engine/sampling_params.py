"""Per-request generation settings, the names vLLM and OpenAI users know."""
import json
import math
import struct
from dataclasses import dataclass, field

# Temperatures below this sample greedily: the sampler divides float32 logits by the float32 temperature, and a
# tiny one (1e-45 is a float32 denormal) overflows them to inf, whose softmax is NaN (vLLM uses the same 1e-5).
GREEDY_TEMPERATURE = 1e-5


def _float32(x: float) -> float:
    """x as the float32 the sampler divides by (x in [0, 1]: no overflow when packing)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class StructuredSpec:
    """What a constrained request's output must be (lowbit.serve.engine.structured compiles it):
    json_object: any JSON object; json_schema: an instance of `schema`; tool_calls: a JSON array of calls
    [{"name", "arguments"}] of `tools` ({"name", "parameters"} each; single: exactly one call); tool_tags: free text
    in which each call is written <tool_call>{"name": ..., "arguments": ...}</tool_call>."""
    kind: str
    schema: dict | None = None
    tools: tuple = ()
    single: bool = False

    def key(self) -> str:
        return json.dumps([self.kind, self.schema, list(self.tools), self.single], sort_keys=True)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (needs the whole prompt computed)
    structured: StructuredSpec | None = None  # a grammar the output must follow (response_format, tools)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raises ValueError with a message fit for a 400 response."""
        numbers = {"temperature": self.temperature, "top_p": self.top_p}
        for name, value in numbers.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0 or -1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        """Whether the sampler takes the argmax: temperature 0, one below GREEDY_TEMPERATURE as the float32 value
        the sampler would use, or top_k 1."""
        return _float32(min(self.temperature, 1.0)) < GREEDY_TEMPERATURE or self.top_k == 1
