"""lowbit: quantize a Hugging Face LLM, gate its accuracy, serve it on low-precision kernels.

    import lowbit
    lowbit.quantize("smollm2-135m", recipe="fp8")           # -> store entry smollm2-135m-fp8
    llm = lowbit.LLM("smollm2-135m-fp8")
    llm.generate(["Hello"], lowbit.SamplingParams(max_tokens=16))
"""
__version__ = "0.1.0"

# Binds the name `lowbit.quantize` to the function (the subpackage stays importable as lowbit.quantize.*).
from lowbit.quantize.api import quantize  # noqa: E402  (imports no modelopt until called)


def __getattr__(name):
    if name in ("LLM", "SamplingParams"):
        import lowbit.serve as serve

        return getattr(serve, name)
    raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
