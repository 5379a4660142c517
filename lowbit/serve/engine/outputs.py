"""What the engine hands back per request and step (vLLM's names). Logprob entries are (logprob, [(id, logprob)]).

A request gets an output each step it changes, built in time proportional to what is new (never to its length):
delta_text / delta_token_ids / delta_logprobs are what is new since its previous output. outputs[0].text, token_ids
and logprobs are cumulative on the final output (finished=True) only; before that they hold the same delta.
prompt_token_ids and prompt_logprobs are the request's own lists, shared by all its outputs: read, never mutate.
"""
from dataclasses import dataclass, field

Logprob = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative on the final output, this step's delta before (see above)
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None  # stop | length | abort, None while running


@dataclass(slots=True)
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
