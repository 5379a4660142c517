"""serve: a paged, continuous-batching engine and an OpenAI-compatible HTTP API (api.py, the only FastAPI user)."""
from lowbit.serve.config import EngineConfig
from lowbit.serve.llm import LLM
from lowbit.serve.outputs import CompletionOutput, RequestOutput
from lowbit.serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
