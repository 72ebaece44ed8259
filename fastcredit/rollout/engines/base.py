"""The generation-engine interface the agent loop, the judges and the trainer use.

An engine continues generation from token ids (stop strings and stop tokens included in
the output, optional per-token log-probs), batches concurrent ``agenerate`` calls (here: a
micro-batcher by size and time; the vLLM engine overrides it with continuous batching),
sleeps and wakes (vLLM sleep mode; a device move for HF), and loads new weights from an
iterator of ``(name, tensor)`` pairs streamed one at a time.
"""
from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from fastcredit.runtime.threads import rollout_executor


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    stop: list = field(default_factory=list)  # stop strings; the matched one is part of the output
    stop_token_ids: list = field(default_factory=list)  # e.g. EOS; the stop token is part of the output
    logprobs: bool = False  # the sampled tokens' log-probs under the temperature-scaled logits
    seed: Optional[int] = None  # per-request seed: the same request gives the same tokens
    # An output grammar (fastcredit.judges.grammar.Grammar): vLLM decodes under its regex(max_tokens)
    # (structured outputs), the HF engine masks logits with its decoder(); the row ends when it is complete.
    constraint: Optional[Any] = None


@dataclass
class StepCounters:
    """What an engine's steps did since its counters were last taken (:meth:`Engine.take_step_counters`): how many
    sequences each step ran, which steps took new requests in (their prompts are prefilled there: the HF engine's
    prefill forward; vLLM's scheduler step that added them, as far as its token budget a step allows), the seconds
    of each kind, and the finished requests' prompt tokens, those the prefix cache served (vLLM's
    ``RequestOutput.num_cached_tokens``; the HF engine's prefix hits) and the tokens they decoded."""

    steps: int = 0
    step_s: float = 0.0
    seqs: int = 0  # requests in flight, summed over the steps
    admit_steps: int = 0  # steps that added requests to the engine
    admit_s: float = 0.0
    admit_seqs: int = 0
    requests: int = 0  # finished
    prompt_tokens: int = 0
    cached_tokens: int = 0
    decoded_tokens: int = 0

    def metrics(self) -> dict:
        """``engine/*`` step metrics: means per step, seconds, tokens and the prefix cache's hit rate."""
        decode_steps = self.steps - self.admit_steps
        return {"engine/steps": float(self.steps), "engine/step_s": self.step_s,
                "engine/seqs_per_step": self.seqs / max(self.steps, 1),
                "engine/admit_steps": float(self.admit_steps), "engine/admit_step_s": self.admit_s,
                "engine/decode_step_s": self.step_s - self.admit_s,
                "engine/decode_seqs_per_step": (self.seqs - self.admit_seqs) / max(decode_steps, 1),
                "engine/prompt_tokens": float(self.prompt_tokens), "engine/cached_tokens": float(self.cached_tokens),
                "engine/prefix_hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
                "engine/decoded_tokens": float(self.decoded_tokens),
                # prompt tokens computed (not served by the prefix cache) per token decoded
                "engine/prefill_per_decoded": (self.prompt_tokens - self.cached_tokens) / max(self.decoded_tokens, 1)}


@dataclass
class GenOutput:
    token_ids: list
    logprobs: Optional[list]
    finish_reason: str  # "stop" | "length"
    stop_reason: Optional[Union[str, int]] = None  # the stop string or stop token matched
    version: Optional[int] = None  # the engine's weights_version when the request started


class Engine(abc.ABC):
    """Batched generation over token ids; see the module docstring."""

    tokenizer = None
    weight_dtype: torch.dtype = torch.float32  # what update_weights wants streamed (the sync casts shards to it)
    # The policy version (updates done) of the weights loaded: the trainer's PhaseManager sets it after each weight
    # sync; every GenOutput carries it, every turn records it (TrajectoryBatch.seg_version_S).
    weights_version: int = 0
    # Called before each scheduler step (a micro-batch of the HF engine, an engine step of vLLM) in the engine's
    # own thread: a split placement's in-flight weight loads (rollout.partial) happen there.
    between_steps: Optional[Callable[[], None]] = None
    # Whether a request that arrives while a batch decodes joins it at the next step (continuous batching): what
    # rollout.mode=auto asks (fastcredit.rollout.build.rollout_mode).
    batches_in_flight: bool = False

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]]) -> list[GenOutput]:
        """One batch, synchronously; ``params`` per request or shared."""

    def generate_text(self, prompts: Sequence[str], max_tokens: int,
                      temperature: Union[float, Sequence[float]] = 0.0, tokenizer=None,
                      seeds: Optional[Sequence[Optional[int]]] = None,
                      constraints: Optional[Sequence[Any]] = None) -> list[str]:
        """Raw text in, generated text out (judges); EOS ends a completion. ``tokenizer``: the one that
        encodes, decodes and names EOS (a critic whose weights are switched into this engine brings its own).
        ``temperature``, ``seeds`` and ``constraints`` (output grammars) may be given per prompt."""
        tok = tokenizer or self.tokenizer
        ids = [list(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        n = len(prompts)
        temps = [float(temperature)] * n if isinstance(temperature, (int, float)) else list(temperature)
        seeds = list(seeds) if seeds is not None else [None] * n
        constraints = list(constraints) if constraints is not None else [None] * n
        params = [SamplingParams(max_tokens=max_tokens, temperature=t, stop_token_ids=eos, seed=s,
                                 constraint=c if c is None or tokenizer is None else c.bind(tok))
                  for t, s, c in zip(temps, seeds, constraints)]
        outs = self.generate(ids, params)
        return [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]

    def sleep(self, level: int = 1) -> None:
        """Free the device memory this engine holds (level 1 keeps weights in host memory)."""

    def wake_up(self, tags: Optional[list] = None) -> None:
        """Take back what :meth:`sleep` freed (``tags``: ``weights``, ``kv_cache``; None: both)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, one tensor at a time, by HF parameter name."""

    def load_between_steps(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights from inside :attr:`between_steps` (requests may be running; none is dropped)."""
        self.update_weights(named_tensors)

    def close(self) -> None:
        pass

    def take_step_counters(self) -> dict:
        """What the engine's steps did since the last call (``engine/*`` metrics: steps, sequences a step, prefill
        and prefix-cache tokens), then counted afresh; empty for an engine that keeps none."""
        return {}

    max_batch: int = 256
    batch_timeout_ms: float = 5.0

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> GenOutput:
        """One request; concurrent requests are batched by size and a short time window."""
        from fastcredit.runtime.batching import MicroBatcher

        loop = asyncio.get_running_loop()
        batcher = getattr(self, "_batcher", None)
        if batcher is None or getattr(self, "_batcher_loop", None) is not loop:
            if getattr(self, "_executor", None) is None:  # until end_rollout (fastcredit.runtime.threads)
                self._executor = rollout_executor(getattr(self, "device", None), "engine")
            batcher = MicroBatcher(self._generate_items, self.max_batch, self.batch_timeout_ms, max_queue=1 << 20,
                                   executor=self._executor)
            batcher.start()
            self._batcher, self._batcher_loop = batcher, loop
        return (await batcher.submit([(list(prompt), params)]))[0]

    def end_rollout(self) -> None:
        """Let go of the threads the asynchronous API started (called when a rollout's event loop has ended): a
        worker thread that ran torch ops keeps an OpenMP team alive, and with it every later op of the process
        pays for parked workers (fastcredit.runtime.threads). The next ``agenerate`` starts afresh."""
        executor, self._executor, self._batcher, self._batcher_loop = getattr(self, "_executor", None), None, None, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _generate_items(self, items: list) -> list[GenOutput]:
        if self.between_steps is not None:
            self.between_steps()
        self.batches_run = getattr(self, "batches_run", []) + [len(items)]
        return self.generate([p for p, _ in items], [q for _, q in items])
