"""Structured output: a request's grammar (any JSON object, a JSON schema, tool calls) as a logits mask, with xgrammar.

xgrammar (the optional extra `lowbit[structured]`) was chosen over outlines-core by its per-token cost on the
embedded model's 49,152-token vocabulary: 4.2 us vs 206 us to fill the mask and advance
(dev/scripts/structured_mask_overhead.py). A `Grammars` per engine compiles specs (cached, thread-safe, so the HTTP
layer can compile off the engine thread); each constrained request owns a `GrammarState` (its matcher), advanced with
every token the host learns. Per step, `batch_bitmask` packs the allowed sets of all sampling rows into one int32
tensor [S, ceil(V / 32)] (bit j of word w: token 32 * w + j allowed; all bits set for unconstrained rows), and
`apply_bitmask` sets the disallowed logits to -inf on the logits' device with xgrammar's kernel (no sync per row).

JSON is generated compactly (", " and ": " separators, no other whitespace): a small model cannot loop in whitespace.
"""
import json
import threading
from collections import OrderedDict

import torch

from lowbit.serve.engine.sampling_params import StructuredSpec

MISSING = ("structured output (response_format json_object / json_schema, tools) needs xgrammar: "
           "pip install 'lowbit[structured]'")
TOOL_BEGIN, TOOL_END = "<tool_call>", "</tool_call>"  # how a call is written in tool_choice "auto" mode


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def tool_calls_schema(tools: list[dict], single: bool) -> dict:
    """tools: [{"name", "parameters"}] -> the schema of a JSON array of calls [{"name", "arguments"}], one or more
    (single: exactly one)."""
    call = [{"type": "object", "properties": {"name": {"enum": [t["name"]]}, "arguments": t["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "items": {"anyOf": call}, "minItems": 1} | ({"maxItems": 1} if single else {})


class GrammarState:
    """One request's matcher: which tokens may come next, advanced with each token the host learns."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.terminated = False

    def accept(self, token: int) -> bool:
        """Advances with `token`; False when the grammar refuses it (the request must finish)."""
        ok = self.matcher.accept_token(token)
        self.terminated = not ok or self.matcher.is_terminated()
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles StructuredSpecs for one tokenizer and vocabulary (the logits' width) and makes per-request states."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.cache: OrderedDict = OrderedDict()  # spec key -> CompiledGrammar, least recently used first
        self.cache_size = cache_size
        self.lock = threading.Lock()

    def compile(self, spec: StructuredSpec):
        """-> xgrammar's CompiledGrammar; ValueError (a 400) for a schema it cannot compile."""
        key = spec.key()
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        try:
            compiled = self._compile(spec)
        except RuntimeError as e:  # xgrammar reports bad or unsupported schemas as RuntimeError
            raise ValueError(f"cannot compile the {spec.kind} grammar: {str(e).strip().splitlines()[-1]}") from e
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec):
        c, compact = self.compiler, dict(any_whitespace=False, separators=(", ", ": "))
        if spec.kind == "json_object":  # any JSON object: every property and value allowed
            return c.compile_json_schema(json.dumps({"type": "object"}), strict_mode=False, **compact)
        if spec.kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec.schema), **compact)
        if spec.kind == "tool_calls":  # tool_choice "required" or a named function: a JSON array of calls
            return c.compile_json_schema(json.dumps(tool_calls_schema(list(spec.tools), spec.single)), **compact)
        if spec.kind == "tool_tags":  # tool_choice "auto": free text; after TOOL_BEGIN, a call and TOOL_END
            items = [self.xgr.StructuralTagItem(begin=f'{TOOL_BEGIN}{{"name": {json.dumps(t["name"])}, "arguments": ',
                                                schema=json.dumps(t["parameters"]), end="}" + TOOL_END)
                     for t in spec.tools]
            return c.compile_structural_tag(items, [TOOL_BEGIN])
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def state(self, spec: StructuredSpec) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(self.compile(spec)))


def batch_bitmask(states: list[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """Per sampling row its request's state or None -> the int32 bitmask [S, ceil(V / 32)] on the host (all bits
    set for unconstrained rows), or None when no row is constrained."""
    if all(s is None for s in states):
        return None
    mask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for row, s in enumerate(states):
        if s is not None:
            s.fill(mask, row)
    return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [S, V] float32 (any device), bitmask [S, W] int32 on the host: disallowed logits := -inf in place.
    On a GPU the mask goes up through pinned memory without waiting, and xgrammar's kernel applies all rows at once."""
    import xgrammar as xgr

    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
