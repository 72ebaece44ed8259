"""The rollout's parts, from the config: sampling parameters, prompt ids, the agent loop, and the engine.

    loop = agent_loop(cfg, engine, searcher, greedy=True)         # what training and evaluation roll out with
    mode, why = rollout_mode(cfg.rollout.mode, engine, hook)      # rollout.mode (auto: what the engine gains from)
    ids = prompt_ids(cfg, tokenizer, examples)                    # data.prompt_source / prompt_template, chat template
    engine = rollout_engine(cfg, tokenizer, start, device)        # rollout.engine from an EngineStart
    tokenizer, engine, searcher, kind, device = open_policy(cfg, folder, corpus)   # a saved model, ready to roll out

The trainer decides what an engine starts from (:class:`EngineStart`: the HF engine's own copy of the policy, or a
folder vLLM loads) and, colocated on a GPU, vLLM's share of the memory; evaluation and labelling open a saved
folder with :func:`open_policy`.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fastcredit.config import ConfigError, TrainConfig
from fastcredit.data.prompts import example_prompt_ids


@dataclass
class EngineStart:
    """What the rollout engine starts from: the HF engine's own copy of the policy (``lm``), or vLLM's
    ``folder`` and ``load_format`` (``dummy``: no weights; the first rollout streams them in)."""

    lm: Optional[torch.nn.Module] = None
    folder: Optional[str] = None
    load_format: Optional[str] = None


def sampling_params(cfg: TrainConfig, tokenizer, greedy: bool = False):
    """The rollout's sampling parameters (``rollout.*``); ``greedy``: temperature 0, as evaluation decodes."""
    from fastcredit.rollout.engines.base import SamplingParams

    r = cfg.rollout
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return SamplingParams(max_tokens=r.max_action_tokens, temperature=0.0 if greedy else r.temperature,
                          top_p=1.0 if greedy else r.top_p, top_k=-1 if greedy else r.top_k,
                          # the sampled tokens' log-probs: the behaviour policy's when turns may lag (offpolicy), or
                          # pi_old's themselves (loss.old_logprobs, fastcredit.trainer.step.old_from_rollout)
                          stop_token_ids=eos, seed=None,
                          logprobs=not greedy and (r.max_staleness > 0 or rollout_old_logprobs(cfg)))


def rollout_old_logprobs(cfg: TrainConfig) -> bool:
    """Whether the update may take pi_old's log-probs from the rollout (``loss.old_logprobs``; the device and each
    batch are checked again: :func:`fastcredit.trainer.step.old_from_rollout`)."""
    mode = cfg.loss.old_logprobs
    return mode == "rollout" or (mode == "auto" and cfg.rollout.engine == "hf")


def rollout_mode(mode: str, engine, hook=None) -> tuple[str, str]:
    """``(async | lockstep, why)`` for ``rollout.mode`` (``auto``: the schedule ``engine`` gains from).

    Asynchronous turns pay where the engine batches in flight (``Engine.batches_in_flight``: vLLM's continuous
    batching, where a turn back from its search joins the running batch at the next step). The HF engine decodes
    each call's batch to its end, so a turn cannot join one in flight; measured side by side the two schedules take
    the same time on it (docs/results.md), and lockstep is the plainer one. ProCeed's rewinds run inside a
    trajectory's turns, which only the asynchronous loop has."""
    if mode != "auto":
        return mode, "set by rollout.mode"
    if hook is not None:
        return "async", "ProCeed's rewinds run inside a trajectory's own turns"
    if getattr(engine, "batches_in_flight", False):
        return "async", (f"{type(engine).__name__} batches in flight: a turn back from its search joins the running "
                         "batch")
    return "lockstep", (f"{type(engine).__name__} decodes each call's batch to its end, nothing joins in flight: "
                        "asynchronous turns gain nothing on it")


def agent_loop(cfg: TrainConfig, engine, searcher, greedy: bool = False, hook=None):
    """The agent loop training and evaluation both roll out with (``rollout.*`` limits and mode, ``auto`` resolved
    by :func:`rollout_mode`; ``retrieval.batch_size`` / ``batch_timeout_ms`` for the asynchronous retrieval
    batcher)."""
    from fastcredit.rollout.agent import AgentLimits, AgentLoop

    r = cfg.retrieval
    params = sampling_params(cfg, engine.tokenizer, greedy)
    mode, _ = rollout_mode(cfg.rollout.mode, engine, hook)
    return AgentLoop(engine, searcher, AgentLimits.from_config(cfg.rollout), params, mode=mode,
                     retrieval_batch=r.batch_size, retrieval_timeout_ms=r.batch_timeout_ms, step_hook=hook)


def prompt_ids(cfg: TrainConfig, tokenizer, examples: list) -> list[list[int]]:
    """The examples' prompt token ids, as ``data.prompt_source`` / ``data.prompt_template`` and
    ``model.chat_template`` make them (rollouts, evaluation and the warm start alike)."""
    d = cfg.data
    return example_prompt_ids(tokenizer, examples, d.prompt_source, d.prompt_template, cfg.model.chat_template)


def vllm_start_folder(cfg: TrainConfig, policy_config, tokenizer, out_dir: str, rank: int,
                      modified: bool) -> tuple[str, str]:
    """``(folder, load_format)`` vLLM starts from: the policy's own folder when its weights are as loaded;
    else (tiny / packaged / ``modified``, e.g. warm-started, policies) the policy's config (its ``architectures``
    naming the model class: ``fastcredit.models.build.policy_config``) and tokenizer in the run directory, one
    folder per rank, and ``dummy`` weights: the trainer streams the real ones in before the first rollout (no
    rank writes or reads a weight file)."""
    if os.path.isdir(cfg.model.policy) and not modified:
        return cfg.model.policy, "auto"
    folder = os.path.join(out_dir, f"engine_config_rank{rank}")
    os.makedirs(folder, exist_ok=True)
    # NOTE: the config's own save_pretrained is not used: transformers writes checkpoints on rank 0 only
    copy.deepcopy(policy_config).to_json_file(os.path.join(folder, "config.json"))
    tokenizer.save_pretrained(folder)
    return folder, "dummy"


def rollout_engine(cfg: TrainConfig, tokenizer, start: EngineStart, device,
                   memory_utilization: Optional[float] = None):
    """The engine ``rollout.engine`` names, started from ``start`` on ``device`` (vLLM: with
    ``memory_utilization`` of the GPU, None for ``rollout.gpu_memory_utilization``)."""
    from fastcredit.rollout.engines import make_engine

    kw = {}
    if cfg.rollout.engine == "vllm":
        kw = {"model_path": start.folder, "memory_utilization": memory_utilization, "load_format": start.load_format}
    return make_engine(cfg.rollout.engine, start.lm, tokenizer, cfg.rollout, device=device, **kw)


def pick_engine(kind: str) -> str:
    """``auto`` | ``vllm`` | ``hf`` → the engine evaluation opens a folder with (auto: vLLM on a GPU when it
    imports, else the HF engine)."""
    if kind not in ("auto", "vllm", "hf"):
        raise ConfigError(f"--engine {kind!r}: valid: auto, vllm, hf")
    if kind != "auto":
        return kind
    if not torch.cuda.is_available():
        return "hf"
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def engine_from_folder(kind: str, folder: str, tokenizer, cfg: TrainConfig, device):
    """An engine (``hf`` or ``vllm``) over a saved Hugging Face folder, in the config's compute dtype on a GPU."""
    from fastcredit.rollout.engines import make_engine

    if kind == "vllm":
        return make_engine("vllm", None, tokenizer, cfg.rollout, device=device, model_path=folder)
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.model.dtype)
    lm = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, local_files_only=True).to(device).eval()
    return make_engine("hf", lm, tokenizer, cfg.rollout, device=device)


def open_policy(cfg: TrainConfig, folder: str, corpus: str, engine: str = "auto", progress: bool = True,
                info=None, make_engine: Callable = engine_from_folder, observations: str = "real"):
    """``(tokenizer, engine, searcher, engine kind, device)``: the model in ``folder`` ready to roll out on this
    process's device with the config's retriever (``engine``: auto | vllm | hf; ``make_engine(kind, folder,
    tokenizer, cfg, device)`` builds it). ``info``: under torchrun, this rank's DistInfo: its own GPU, and the
    retrieval index split over the ranks as training splits it (``retrieval.across_ranks``; every rank must call
    this together). ``observations``: an evaluation's closed-book control (``eval.observations``; ``real``: none)."""
    from fastcredit.data.tokenizer import load_tokenizer
    from fastcredit.retrieval.searcher import make_searcher

    device = info.device if info is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(folder)  # the class the folder names, as training tokenized
    kind = pick_engine(engine)
    gen = make_engine(kind, folder, tokenizer, cfg, device)
    try:
        searcher, retriever = make_searcher(cfg, tokenizer, corpus, progress=progress, device=device,
                                            info=info if info is not None and info.distributed else None)
        if observations != "real":
            from dataclasses import replace

            from fastcredit.retrieval.searcher import eval_searcher

            searcher = eval_searcher(replace(cfg, eval=replace(cfg.eval, observations=observations)), searcher,
                                     retriever, tokenizer, info is not None and info.distributed)
    except BaseException:
        gen.close()
        raise
    return tokenizer, gen, searcher, kind, device
