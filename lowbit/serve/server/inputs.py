"""Prompt preparation off the event loop and the engine thread: chat templating, tokenization and the length checks.

A fast (Rust) tokenizer releases the GIL while it encodes, so a multi-MB prompt tokenized on a worker thread costs
other streams nothing; on the engine thread it would stop every stream for seconds. Each worker has its own copy
of the tokenizer (a fast tokenizer's padding/truncation state is mutated per call, which concurrent calls on one
object refuse), made at start-up: a copy holds the GIL for ~0.3 s. Before any of that work a prompt longer than `max_model_len * longest token` characters is
refused: no tokenization of it could fit the context. The workers run at a lower OS priority (Linux: nice is per
thread), so that on a machine with few cores the engine thread keeps its core while they tokenize.
No HTTP imports here.
"""
import asyncio
import copy
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from lowbit.serve.engine.engine import ContextLengthError

WORKERS = 2  # prompts tokenized at once; more queue behind them, running streams are not affected
NICE = 10  # the workers' niceness increment: the kernel gives a nice-0 thread ~10x their CPU share


class PromptError(ValueError):
    """A prompt the server refuses (HTTP 400); `param` names the request field."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry as stored (byte-level
    BPE stores one character per byte, SentencePiece '▁' for a space, byte-fallback tokens as '<0xAB>': never
    fewer characters than the text they stand for)."""
    return max(len(t) for t in tokenizer.get_vocab())


def _lower_priority() -> None:
    """Runs on each new worker thread: raises its niceness by NICE (where the OS sets it per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
    except (AttributeError, OSError):  # no per-thread priority here: the workers compete as equals
        pass


class PromptProcessor:
    def __init__(self, engine):
        """engine: the Engine (read only: its tokenizer to copy, max_model_len, check_prompt)."""
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.max_chars = engine.max_model_len * longest_token_chars(engine.tokenizer)
        self._spare: queue.SimpleQueue = queue.SimpleQueue()  # one tokenizer per worker, taken on its first call
        for _ in range(WORKERS):
            self._spare.put(copy.deepcopy(engine.tokenizer))
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="lowbit-tokenize", initializer=_lower_priority)

    async def completion(self, prompts: list[str | list[int]]) -> list[tuple[list[int], str | None]]:
        """Completion prompts (texts or token ids) -> (token ids, text or None) each; raises PromptError."""
        for p in prompts:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
            elif len(p) >= self.max_model_len:
                self._check_ids(p, "prompt")
        return await self._run(self._completion, prompts)

    async def chat(self, messages: list[dict]) -> list[int]:
        """Chat messages ({role, content: str}) -> the token ids of the templated conversation; raises PromptError."""
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return await self._run(self._chat, messages)

    # ---- checks (any thread)
    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise PromptError(f"the prompt has {chars} characters, more than any {self.max_model_len} tokens of this "
                              f"model's vocabulary make ({self.max_chars}); this model's context is "
                              f"{self.max_model_len} tokens", param, "context_length_exceeded")

    def _check_ids(self, ids: list[int], param: str) -> None:
        try:
            self.engine.check_prompt(ids)
        except ContextLengthError as e:
            raise PromptError(str(e), param, "context_length_exceeded") from e
        except ValueError as e:
            raise PromptError(str(e), param) from e

    # ---- on a worker thread
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = self._spare.get_nowait()  # WORKERS threads: never more takers than copies
        return tok

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            ids = self._tokenizer().encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take (the request models check Unicode)
            raise PromptError(f"the {param} could not be tokenized: {e}", param) from e
        self._check_ids(ids, param)
        return ids

    def _completion(self, prompts: list[str | list[int]]) -> list[tuple[list[int], str | None]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((self._encode(p, "prompt", True), p))
            else:
                self._check_ids(p, "prompt")
                out.append((list(p), None))
        return out

    def _chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self._tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises its own errors for conversations the template refuses
            raise PromptError(f"chat template: {e}", "messages") from e
        return self._encode(text, "messages", False)  # the template wrote the special tokens
