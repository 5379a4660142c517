"""Per-request generation settings, the names vLLM and OpenAI users know."""
import json
from dataclasses import dataclass, field


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
    temperature: float = 1.0  # 0 means greedy
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
        return self.temperature == 0 or self.top_k == 1
