"""OpenAI request bodies (pydantic, shipped with FastAPI) and their mapping onto SamplingParams."""
from typing import Literal

from pydantic import BaseModel, ConfigDict

from lowbit.serve.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    response_format: dict | None = None  # text | json_object | json_schema: server/structured_output.py
    tools: list | None = None  # chat only, with tool_choice
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" gives exactly one call

    def check_unsupported(self) -> None:
        """Refuse, rather than ignore, what the engine does not do."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)

    def sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
                 ) -> SamplingParams:
        self.check_unsupported()
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, stop=self.stop or [],
                                  stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from e


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(p)

    def params(self) -> SamplingParams:
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.tools or self.tool_choice is not None:
            raise APIError(400, "tools are supported in /v1/chat/completions only", param="tools")
        wants_prompt = self.echo and self.logprobs is not None
        return self.sampling(self.max_tokens, self.logprobs, self.logprobs if wants_prompt else None)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, written back into its text

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
        if len(parts) != len(self.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def params(self) -> SamplingParams:
        if not self.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        n = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, n)
