"""Model families by HF architecture name."""
from lowbit.serve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from lowbit.serve.models.llama import LlamaForCausalLM
from lowbit.serve.models.mistral import MistralForCausalLM
from lowbit.serve.models.mixtral import MixtralForCausalLM
from lowbit.serve.models.phi3 import Phi3ForCausalLM
from lowbit.serve.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from lowbit.serve.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class(config: dict):
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"architecture {config.get('architectures')} is not supported; supported: {sorted(ARCHITECTURES)}")
