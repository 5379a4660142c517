"""The engine loop: add requests, then `step()` = schedule -> run the model -> sample -> detokenize -> outputs."""
import atexit
import gc
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lowbit import checkpoint, models
from lowbit.serve.engine.block_manager import BlockManager
from lowbit.serve.engine.config import EngineConfig
from lowbit.serve.engine.detokenizer import Detokenizer, decoder
from lowbit.serve.engine.metrics import EngineMetrics
from lowbit.serve.runner.model_runner import ModelRunner, PendingTokens
from lowbit.serve.engine.outputs import CompletionOutput, RequestOutput
from lowbit.serve.runner.sampler import SampledLogprobs, Sampler, chosen_and_top, sampled_logprobs
from lowbit.serve.engine.sampling_params import SamplingParams
from lowbit.serve.engine.scheduler import Batch, Scheduler
from lowbit.serve.engine.sequence import PENDING, Sequence
from lowbit.serve.engine import structured
from lowbit.serve.spec.decoder import make_decoder
from lowbit.serve.spec.draft_model import load_draft_runner


class ContextLengthError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


@dataclass
class Request:
    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer
    seed: int  # sampling noise comes from (seed, position): lowbit.serve.runner.sampler
    max_tokens: int
    prompt_token_ids: list[int]  # shared by every RequestOutput of the request: never mutated
    stream: bool  # False: only the final output is built
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    num_sent_tokens: int = 0  # completion tokens already reported in a RequestOutput
    grammar: "structured.GrammarState | None" = None  # structured output: the tokens allowed next


@dataclass
class InFlight:
    """A launched step whose sampled tokens (and logprobs) are still on the device (overlapped steps)."""
    batch: Batch
    sampled: list[tuple[Sequence, int]]  # (sequence, index of its PENDING token in token_ids), in sampling order
    tokens: torch.Tensor | None  # [len(sampled)] int64 on the device
    logprobs: SampledLogprobs | None = None
    host: list[torch.Tensor] = field(init=False, default_factory=list)  # the tensors, copied to pinned memory
    copied: torch.cuda.Event | None = field(init=False, default=None)

    def __post_init__(self):
        self.host = [self.tokens, *(self.logprobs.tensors if self.logprobs else ())] if self.tokens is not None else []
        if self.host and self.tokens.is_cuda:  # start the copies now; results() waits for them
            self.host = [_pinned_copy(t) for t in self.host]
            self.copied = torch.cuda.Event()
            self.copied.record()

    def results(self) -> tuple[list[int], list]:
        """(token ids, per sampled row (logprob, top) or None), waiting for the device."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, *logprobs = (t.tolist() for t in self.host)
        return tokens, self.logprobs.entries(len(tokens), *logprobs) if self.logprobs else [None] * len(tokens)


def _tensor_parallel_runner(ckpt, config: EngineConfig):
    from lowbit.serve.distributed.runner import TensorParallelRunner

    return TensorParallelRunner(ckpt, config)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _without_finished(batch: Batch) -> Batch | None:
    """The batch less the sequences that finished since it was planned (their blocks are freed)."""
    if not any(s.is_finished for s in batch.seqs):
        return batch
    kept = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if not s.is_finished]
    return Batch([s for s, _ in kept], [n for _, n in kept]) if kept else None


class Engine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, ckpt=None, tokenizer=None,
                 draft_ckpt=None):
        """ckpt / tokenizer / draft_ckpt: given objects instead of reading them from the model's (and the draft
        model's) directory (dummy weights)."""
        from transformers import AutoTokenizer

        self.config = config or EngineConfig()
        if self.config.data_parallel_size != 1:  # replicas are processes behind the server (server/dp_engine.py)
            raise ValueError("data_parallel_size > 1 is served by `lowbit serve --dp-size N`; an Engine or LLM is "
                             "one replica (use tensor_parallel_size to split one model)")
        self.path = models.resolve(str(model)) if ckpt is None else ckpt.path
        self.name = str(model)
        ckpt = ckpt or checkpoint.read(self.path)
        draft_runner = load_draft_runner(self.config, ckpt, draft_ckpt) if self.config.speculative == "draft" else None
        self.runner = ModelRunner(ckpt, self.config, kv_partner=draft_runner) if self.config.tensor_parallel_size == 1 \
            else _tensor_parallel_runner(ckpt, self.config)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.path)
        self.block_manager = BlockManager(self.runner.kv_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, self.runner.num_host_blocks,
                                          sliding_window=self.runner.kv_windows)
        self.scheduler = Scheduler(self.block_manager, self.config.max_batch_size, self.config.max_num_tokens)
        limits = [ckpt.config.get("max_position_embeddings", 4096), self.runner.num_blocks * self.config.block_size]
        self.max_model_len = min(limits + ([self.config.max_model_len] if self.config.max_model_len else []))
        self.eos_token_ids = _eos_token_ids(self.path, ckpt.config, self.tokenizer)
        self.decode = decoder(self.tokenizer)  # ids -> text, shared by every request's Detokenizer
        self.sampler = Sampler()
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        self.overlap = self.config.overlap_steps if self.config.overlap_steps is not None else \
            self.runner.device.type == "cuda" and self.config.tensor_parallel_size == 1
        self.in_flight: InFlight | None = None
        self.scoring: set[str] = set()  # requests whose prompt steps need the logits on the host (_scores_prompt)
        self._seed = random.Random(self.config.seed)
        self.spec = make_decoder(self.config, self.runner, draft_runner)  # speculative decoding (None: off)
        self._grammars: structured.Grammars | None = None
        self.constrained: set[str] = set()  # requests with a grammar: their steps run without overlap
        _freeze_startup_heap()

    def close(self) -> None:
        """Stops the engine's other processes (tensor-parallel ranks); nothing to do in one process."""
        self.runner.close()

    @property
    def grammars(self) -> "structured.Grammars":
        """The grammar compiler for this tokenizer and vocabulary (made on first use; needs xgrammar).
        Thread-safe: the HTTP layer compiles specs with it off the engine thread."""
        if self._grammars is None:
            if not structured.available():
                raise ValueError(structured.MISSING)
            self._grammars = structured.Grammars(self.tokenizer, self.runner.model.config["vocab_size"],
                                                 sorted(self.eos_token_ids))
        return self._grammars

    # ---- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    stream: bool = True, prompt_text: str | None = None) -> None:
        """Raises ValueError for a bad prompt (empty, out-of-vocabulary ids, too long).
        prompt: text (tokenized here, on the caller's thread) or token ids; the server tokenizes on its own
        threads and passes ids, with prompt_text, the text they came from (for echo), when there was one.
        stream=False: the request gets one RequestOutput, the final one, and its text is decoded once at the end."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else prompt_text
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seed = params.seed if params.seed is not None else self._seed.getrandbits(63)
        grammar = self.grammars.state(params.structured) if params.structured is not None else None
        seq = Sequence(ids, params, request_id)
        detokenizer = Detokenizer(self.tokenizer, ids, params.stop, self.decode, once=not stream)
        self.requests[request_id] = Request(seq, text, detokenizer, seed, max_tokens, ids, stream, grammar=grammar)
        if grammar is not None:
            self.constrained.add(request_id)
        if params.prompt_logprobs is not None or max_tokens == 0:
            self.scoring.add(request_id)
        self.metrics.prompt_tokens += len(ids)
        self.scheduler.add(seq)

    def check_prompt(self, ids: list[int]) -> None:
        """Raises ValueError for prompt token ids the engine cannot take (empty, out of the vocabulary) and
        ContextLengthError for too many. Reads only fields fixed at start-up: callable from any thread."""
        vocab = self.runner.model.config["vocab_size"]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(f"the prompt has {len(ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens, including at least one to generate")
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        self.scoring.discard(request_id)
        self.constrained.discard(request_id)
        if request is not None and not request.seq.is_finished:
            self.scheduler.finish(request.seq, "abort")
            self.metrics.on_finish("abort")
        if request is not None and self.spec is not None:
            self.spec.release(request.seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    # ---- one step
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of the requests that changed. With overlapped steps the
        step is only launched, and the outputs are those of the previous step, whose tokens the device has sampled
        meanwhile: the host schedules and prepares step n+1 while the device computes step n."""
        batch = self.scheduler.schedule()
        self.runner.move_blocks(self.block_manager.take_moves())  # host-pool copies, before any forward reads them
        if self.spec is None or batch is None or not batch.is_decode or self._is_constrained(batch):
            return self._plain_step(batch)
        started, steady = self.spec.clock(), self.in_flight is not None or not self.overlap
        outputs = self._spec_step(batch) if self.spec.speculates(batch) else self._plain_step(batch)
        self.spec.timed(len(batch.seqs), started, steady)
        return outputs

    def _spec_step(self, batch: Batch) -> list[RequestOutput]:
        """Drafts and verifies (no grammar: a mask needs each token before it)."""
        outputs = self._resolve()  # drafts need every sequence's newest token on the host
        batch = _without_finished(batch)
        return outputs + (self.spec.step(self, batch) if batch is not None else [])

    def _plain_step(self, batch: Batch | None) -> list[RequestOutput]:
        """Launched (overlapped), or run at once where the host needs its tokens first."""
        if batch is not None and (not self.overlap or self._scores_prompt(batch) or self._is_constrained(batch)):
            outputs = self._resolve()  # the in-flight tokens may finish sequences of this batch
            batch = _without_finished(batch)
            return outputs + (self._step_now(batch) if batch is not None else [])
        launched = self._launch(batch) if batch is not None else None
        outputs = self._resolve()
        self.in_flight = launched
        if launched is not None:  # every token of its full blocks is known now
            self.scheduler.commit_full_blocks(launched.batch.seqs)
        return outputs

    def _scores_prompt(self, batch: Batch) -> bool:
        """Whether the host must read this step's logits at once: prompt logprobs still to score, or a
        max_tokens=0 request (its prompt is all it computes)."""
        return bool(self.scoring) and any(s.request_id in self.scoring and s.num_computed_tokens < s.num_prompt_tokens
                                          for s in batch.seqs)

    def _is_constrained(self, batch: Batch) -> bool:
        """Whether a sequence of the batch follows a grammar: its mask needs the token before, so its steps run at
        once (never launched with a PENDING token); the other sequences' in-flight tokens are resolved first."""
        return bool(self.constrained) and any(s.request_id in self.constrained for s in batch.seqs)

    def _step_now(self, batch: Batch) -> list[RequestOutput]:
        """A step whose logits the host needs at once (`_scores_prompt`), or any step without overlap."""
        rows = self._logit_rows(batch)
        logits = self.runner.run(batch, rows)
        last_rows = self._record_prompt_logprobs(batch, rows, logits)
        self.scheduler.update(batch)
        sampled, changed = [], []
        for seq, row in zip(batch.seqs, last_rows):
            if row is None:
                continue
            if self.requests[seq.request_id].max_tokens == 0:  # prompt logprobs only
                self._finish(seq, "length")
                changed.append(seq)
            else:
                sampled.append((seq, row))
        if sampled:
            self._sample(sampled, logits)
            changed += [s for s, _ in sampled]
        self.metrics.on_step(len(sampled))
        return [self._output(s) for s in changed if s.is_finished or self.requests[s.request_id].stream]

    def _launch(self, batch: Batch) -> "InFlight":
        """Queues the batch and its sampling on the device; each sampling sequence gets a PENDING token."""
        rows = self._logit_rows(batch)
        pending = None
        if self.in_flight is not None and self.in_flight.sampled:
            row_of = {seq.seq_id: i for i, (seq, _) in enumerate(self.in_flight.sampled)}
            pending = PendingTokens(self.in_flight.tokens, np.fromiter(
                (row_of.get(s.seq_id, -1) for s in batch.seqs), np.int64, len(batch.seqs)))
        logits = self.runner.run(batch, rows, pending)
        last_rows = self._record_prompt_logprobs(batch, rows, logits)
        self.scheduler.update(batch, commit=False)
        sampled = [(seq, row) for seq, row in zip(batch.seqs, last_rows) if row is not None]
        if not sampled:
            return InFlight(batch, [], None)
        assert len(sampled) == logits.shape[0]  # no prompt logprobs here: the logits rows are the sampling rows
        seqs = [seq for seq, _ in sampled]
        reqs = [self.requests[s.request_id] for s in seqs]
        params = [s.params for s in seqs]
        tokens = self.sampler.sample(logits, params, [q.seed for q in reqs], [s.num_tokens for s in seqs])
        placed = []
        for seq, request in zip(seqs, reqs):
            placed.append((seq, seq.num_tokens))
            seq.append_token(PENDING)
            seq.stopping = seq.num_completion_tokens >= request.max_tokens
        return InFlight(batch, placed, tokens, sampled_logprobs(logits, tokens, params))

    def _resolve(self) -> list[RequestOutput]:
        """Reads the in-flight step's tokens (waiting for the device) into their sequences; returns the outputs."""
        step, self.in_flight = self.in_flight, None
        if step is None or not step.sampled:
            return []
        tokens, logprobs = step.results()
        now = time.monotonic()
        changed = []
        for (seq, index), token, logprob in zip(step.sampled, tokens, logprobs):
            request = self.requests.get(seq.request_id)
            if request is None or seq.is_finished:  # aborted, or finished by its previous token
                continue
            seq.token_ids[index] = token
            if logprob is not None:
                seq.logprobs.append(logprob)
            self._on_token(seq, request, token, now, index + 1 - seq.num_prompt_tokens)
            if seq.is_finished:
                del seq.token_ids[index + 1:]  # the token launched after this one, if any, is not part of it
            changed.append((seq, index + 1 - seq.num_prompt_tokens))
        self.metrics.on_step(len(changed))
        return [self._output(s, n) for s, n in changed if s.is_finished or self.requests[s.request_id].stream]

    def _logit_rows(self, batch: Batch) -> list[list[int]]:
        """Per sequence, the offsets within its new tokens whose logits are wanted."""
        if batch.is_decode:  # each sequence samples from its one row; no prompt token is left to score
            return [[0]] * len(batch.seqs)
        return [self._rows_of(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]

    @staticmethod
    def _rows_of(seq: Sequence, n: int) -> list[int]:
        samples = seq.num_computed_tokens + n == seq.num_tokens
        if seq.wants_prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens:
            return list(range(n))
        return [n - 1] if samples else []

    def _record_prompt_logprobs(self, batch: Batch, rows: list[list[int]], logits: torch.Tensor
                                ) -> list[int | None] | range:
        """Stores prompt logprobs; returns per sequence the logits row to sample from (None: no sampling)."""
        if batch.is_decode:  # one row each, every sequence samples, no prompt token left to score
            return range(len(batch.seqs))
        last_rows, offset, scored = [], 0, []
        for seq, n, r in zip(batch.seqs, batch.num_new_tokens, rows):
            start = seq.num_computed_tokens
            if seq.wants_prompt_logprobs and r:  # row j predicts prompt token start + j + 1, if not scored yet
                keep = [j for j in range(n) if start + j + 1 < seq.num_prompt_tokens
                        and len(seq.prompt_logprobs) <= start + j + 1]
                if keep:
                    scored.append((seq, [offset + j for j in keep], [seq.token_ids[start + j + 1] for j in keep]))
            samples = start + n == seq.num_tokens
            last_rows.append(offset + len(r) - 1 if samples else None)
            offset += len(r)
        if scored:
            _score_prompt_rows(logits, scored)
        return last_rows

    def _sample(self, sampled: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
        """Samples each sequence's next token from its row and appends it (rows ascend, so all rows = all logits)."""
        if len(sampled) < logits.shape[0]:
            logits = logits[[r for _, r in sampled]]
        reqs = [self.requests[s.request_id] for s, _ in sampled]
        bitmask = structured.batch_bitmask([q.grammar for q in reqs], logits.shape[-1]) if self.constrained else None
        tokens, logprobs = self.sampler(logits, [s.params for s, _ in sampled], [q.seed for q in reqs],
                                        [s.num_tokens for s, _ in sampled], bitmask)
        now = time.monotonic()
        for (seq, _), request, token, lp in zip(sampled, reqs, tokens, logprobs):
            self._append(seq, request, token, lp, now)

    def _append(self, seq: Sequence, request: Request, token: int, logprob, now: float) -> None:
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._on_token(seq, request, token, now, seq.num_completion_tokens)

    def _on_token(self, seq: Sequence, request: Request, token: int, now: float, num_completion: int) -> None:
        """The host learnt the sequence's completion token number `num_completion`: latency, text, stop checks."""
        if request.last_token_time is None:
            self.metrics.ttft.observe(now - request.arrival)
        else:
            self.metrics.itl.observe(now - request.last_token_time)
        request.last_token_time = now
        p = seq.params
        if request.grammar is not None:
            request.grammar.accept(token)
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            self._finish(seq, "stop")
        elif request.detokenizer.add(token):
            self._finish(seq, "stop")
        elif request.grammar is not None and request.grammar.terminated:  # complete (or, never, refused)
            self._finish(seq, "stop")
        elif num_completion >= request.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scoring.discard(seq.request_id)
        self.constrained.discard(seq.request_id)
        self.scheduler.finish(seq, reason)
        self.metrics.on_finish(reason)
        if self.spec is not None:
            self.spec.release(seq)

    def _output(self, seq: Sequence, num_known: int | None = None) -> RequestOutput:
        """What is new since the request's last output, in O(new): cumulative text / ids / logprobs only once
        finished; until then outputs[0] holds the delta too (see outputs.py). num_known: completion tokens the host
        knows (default: all; a PENDING one may follow them)."""
        request = self.requests[seq.request_id]
        finished, sent = seq.is_finished, request.num_sent_tokens
        num_known = seq.num_completion_tokens if num_known is None else num_known
        request.num_sent_tokens = num_known
        delta_ids = seq.token_ids[seq.num_prompt_tokens + sent:seq.num_prompt_tokens + num_known]
        delta_logprobs = seq.logprobs[sent:]
        delta_text = request.detokenizer.take(finished)
        wants_logprobs = seq.params.logprobs is not None
        if finished:
            del self.requests[seq.request_id]
            completion = CompletionOutput(0, request.detokenizer.text, seq.completion_token_ids,
                                          seq.logprobs if wants_logprobs else None, seq.finish_reason)
        else:
            completion = CompletionOutput(0, delta_text, delta_ids, delta_logprobs if wants_logprobs else None, None)
        return RequestOutput(seq.request_id, request.prompt, request.prompt_token_ids,
                             seq.prompt_logprobs if seq.wants_prompt_logprobs else None, [completion], finished,
                             delta_text, delta_ids, delta_logprobs)

    # ---- state for /metrics and tests
    def gauges(self) -> dict[str, tuple[float, str]]:
        bm = self.block_manager
        hit_rate = bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0
        return {"lowbit_requests_waiting": (len(self.scheduler.waiting), "Requests in the queue."),
                "lowbit_requests_running": (len(self.scheduler.running), "Requests in the running batch."),
                "lowbit_kv_blocks_used": (bm.num_used_blocks, "KV cache blocks in use."),
                "lowbit_kv_blocks_total": (bm.num_blocks, "KV cache blocks in the pool."),
                "lowbit_prefix_cache_hit_rate": (hit_rate, "Prompt tokens found in the prefix cache / looked up."),
                "lowbit_preemptions_total": (self.scheduler.num_preemptions, "Sequences preempted for recompute."),
                "lowbit_host_cache_hit_tokens_total": (bm.num_host_hit_tokens, "Prompt tokens restored from the "
                                                       "host KV cache instead of recomputed."),
                "lowbit_host_cache_offloaded_blocks_total": (bm.num_offloaded, "KV blocks copied to the host cache."),
                "lowbit_host_cache_restored_blocks_total": (bm.num_restored, "KV blocks copied back from it."),
                "lowbit_host_cache_bytes_used": (bm.host.num_used * self.runner.host_cache.bytes_per_slot
                                                 if bm.host else 0, "Host memory holding offloaded KV blocks.")} \
            | (self.spec.gauges() if self.spec is not None else {}) | _window_pool_gauges(bm)


def _window_pool_gauges(bm: BlockManager) -> dict[str, tuple[float, str]]:
    """The windowed layers' own KV pool, when the model has one (lowbit_kv_blocks_* count both pools)."""
    if len(bm.pools) < 2:
        return {}
    return {"lowbit_kv_window_blocks_used": (bm.used_blocks_by_kind()[1], "KV blocks in use in the windowed layers' "
                                             "pool."),
            "lowbit_kv_window_blocks_total": (len(bm.pools[1].blocks), "KV blocks in the windowed layers' pool.")}


def _score_prompt_rows(logits: torch.Tensor, scored: list[tuple[Sequence, list[int], list[int]]]) -> None:
    """Prompt logprobs of every scored sequence of a step at once: one log_softmax over the wanted logits rows,
    one gather of the prompt tokens and one top-n on the device, one copy to the host, then split per sequence.
    scored: (sequence, its rows of logits [R, V], the prompt token id each row predicts)."""
    rows = [r for _, seq_rows, _ in scored for r in seq_rows]
    ids = [t for _, _, seq_ids in scored for t in seq_ids]
    index = torch.tensor(rows, device=logits.device)
    lp = logits.index_select(0, index).log_softmax(-1)
    n = max(seq.params.prompt_logprobs for seq, _, _ in scored)
    chosen, values, top = (t.tolist() for t in chosen_and_top(lp, torch.tensor(ids, device=lp.device), n))
    at = 0
    for seq, seq_rows, _ in scored:
        k, end = seq.params.prompt_logprobs, at + len(seq_rows)
        seq.prompt_logprobs += [(c, list(zip(i[:k], v[:k]))) for c, i, v in
                                zip(chosen[at:end], top[at:end], values[at:end])]
        at = end


def _freeze_startup_heap() -> None:
    """Like vLLM: what exists after start-up (modules, the model, the block pool) lives on, so the cyclic collector
    stops scanning it; an oldest-generation collection then pauses a step for ~20 ms instead of ~120 ms (batch 512).
    Unfrozen at exit, so that interpreter shutdown still collects it."""
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)


def _eos_token_ids(path: Path, config: dict, tokenizer) -> set[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in ([json.loads(gen.read_text())] if gen.is_file() else []) + [config]:
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if value is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return set(ids)
