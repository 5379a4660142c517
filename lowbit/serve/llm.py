"""The offline Python API: `LLM(name_or_path).generate(prompts, SamplingParams(...))`."""
from itertools import count

from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.engine import Engine
from lowbit.serve.engine.outputs import RequestOutput
from lowbit.serve.engine.sampling_params import SamplingParams


class LLM:
    """A model served in-process. Keyword arguments are EngineConfig fields (max_batch_size, num_kv_blocks, ...)."""

    def __init__(self, model: str, **engine_args):
        self.engine = Engine(model, EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def close(self) -> None:
        """Stops the engine's other processes (tensor_parallel_size > 1); the LLM cannot generate afterwards."""
        self.engine.close()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. Returns outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order = []
        for prompt, p in zip(prompts, params):
            order.append(f"llm-{next(self._ids)}")
            self.engine.add_request(order[-1], prompt, p, stream=False)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(order):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or several; applies the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in conversations]
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]  # the template has them
        return self.generate(prompts, sampling_params)
