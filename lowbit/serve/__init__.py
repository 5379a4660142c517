"""Serving: `LLM` (offline) and the OpenAI-compatible server (`lowbit serve`) on a paged, continuous-batching engine.

LLM loads on first use, so the torch-free engine parts (scheduler, block manager, sequence) import without torch.
"""
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.outputs import CompletionOutput, RequestOutput
from lowbit.serve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    if name == "LLM":
        from lowbit.serve.llm import LLM

        return LLM
    raise AttributeError(f"module 'lowbit.serve' has no attribute {name!r}")
