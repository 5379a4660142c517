"""OpenAI request bodies (pydantic, shipped with FastAPI) and their mapping onto SamplingParams."""
import dataclasses
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from lowbit.serve.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (documented in the OpenAPI schema)."""
    error: ErrorDetail


def _valid_unicode(s: str) -> str:
    """Refuses text that is not valid Unicode (a lone surrogate such as JSON's "\\ud800"): the tokenizer and the
    UTF-8 response would fail on it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid Unicode (a lone surrogate) at character {e.start}") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopText = Annotated[str, Field(max_length=1024), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]  # below the model's vocabulary size: the served schema states it (api.py)
_ONLY_ZERO = {"minimum": 0, "maximum": 0}
PromptText = Annotated[Text, Field(json_schema_extra={"minLength": 1})]  # one of several prompts: not empty
TokenIds = Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
MAX_PROMPTS = 1024  # prompts in one completion request
MAX_STOP = 16  # stop strings per request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # ranges: OpenAI's documented ones (temperature [0, 2], penalties [-2, 2], n up to 128); NaN / inf refused
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: Text
    max_tokens: int | None = Field(None, ge=0)  # at most max_model_len: api.py
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, lt=1 << 31)  # vLLM extension
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: StopText | list[StopText] | None = Field(None, max_length=MAX_STOP)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=1 << 31)]] | None = Field(None, max_length=1024)  # vLLM
    ignore_eos: bool = False  # vLLM extension
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's range is validated; the schema states what is served (0), and check_unsupported names the field
    presence_penalty: float = Field(0.0, ge=-2, le=2, json_schema_extra=_ONLY_ZERO)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, json_schema_extra=_ONLY_ZERO)
    logit_bias: dict | None = None
    response_format: dict | None = None  # text | json_object | json_schema: server/structured_output.py
    tools: list | None = None  # chat only, with tool_choice
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" gives exactly one call

    def check_unsupported(self) -> None:
        """Refuse, rather than ignore, what the engine does not do."""
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)

    def copies(self, params: SamplingParams) -> list[SamplingParams]:
        """The n choices' parameters: with a seed, choice j samples with seed + j (wrapped into the seed's range), so
        the choices differ and each stays reproducible; choice 0 is what n=1 gives."""
        if self.seed is None:
            return [params] * self.n
        seeds = [self.seed + j - (1 << 64 if self.seed + j >= 1 << 64 else 0) for j in range(self.n)]
        return [dataclasses.replace(params, seed=s) for s in seeds]

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
    # the schema states the non-empty rule that prompts() and the engine enforce (with their own 400 messages)
    prompt: Text | list[PromptText] | list[TokenId] | list[TokenIds] = Field(json_schema_extra={"minLength": 1, "minItems": 1})
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1})  # params() names it
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})  # not served: params() names it

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(p) * self.n > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} choices (prompts times n) per request", param="prompt")
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


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(json_schema_extra={"enum": ["text"]})  # the only part served; ChatMessage.text names others
    text: Text = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, written back into its text

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = [p.text for p in self.content if p.type == "text"]
        if len(parts) != len(self.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(max_length=4096, json_schema_extra={"minItems": 1})  # templating is Python: it holds the GIL
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def params(self) -> SamplingParams:
        if not self.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        n = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, n)
