"""What the engine hands back per request and step (vLLM's names). Logprob entries are (logprob, [(id, logprob)])."""
from dataclasses import dataclass, field

Logprob = tuple[float, list[tuple[int, float]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None  # stop | length | abort, None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Logprob | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # what is new since this request's previous output (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] = field(default_factory=list)
