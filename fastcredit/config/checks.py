"""What ``fastcredit.config.validate`` checks: the range of every number, the rules between keys, and the paths.

    RANGES["optim.grad_clip"]            # Range("(0, inf]", "inf: no clipping")
    check_config(cfg, origins)           # ranges, rules, what the estimator needs; from load_config
    check_paths(cfg, "model")            # the local folders a part of the config names exist; before loading

Ranges use the usual interval notation; a closed end at inf (``"(0, inf]"``) is the one way
to allow inf, so NaN and inf are refused everywhere else. ``also`` lists values outside the
interval that mean something (``rollout.top_k=-1``: off). Every int / float key of the config
has an entry: ``tests/test_config_hardening.py`` fails for a new field without one. No torch
and no ``fastcredit.config`` import here (that module imports this one).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
import typing
from dataclasses import dataclass
from typing import Mapping, Optional


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and its origin."""


class ConfigPathError(ConfigError, FileNotFoundError):
    """A file or folder the config names does not exist (an OSError too, for callers that catch those)."""


@dataclass(frozen=True)
class Range:
    """Allowed values of one key: an interval such as ``"[0, 1)"`` plus the special values in ``also``."""
    spec: str
    note: str = ""  # what the special values (or an allowed inf) mean, shown in the error
    also: tuple = ()

    def __contains__(self, x) -> bool:
        if x in self.also:
            return True
        lo_closed, lo, hi, hi_closed = _bounds(self.spec)
        if math.isnan(x):
            return False
        return (x > lo or (lo_closed and x == lo)) and (x < hi or (hi_closed and x == hi))

    def describe(self) -> str:
        return f"must lie in {self.spec}" + (f" ({self.note})" if self.note else "")


@functools.lru_cache(maxsize=None)
def _bounds(spec: str) -> tuple[bool, float, float, bool]:
    lo, hi = (float(s) for s in spec[1:-1].split(","))
    return spec[0] == "[", lo, hi, spec[-1] == "]"


POS, NONNEG, COUNT, UNIT = "(0, inf)", "[0, inf)", "[1, inf)", "[0, 1]"
RANGES: dict[str, Range] = {
    "seed": Range("[0, 4294967296)", "numpy seeds are 32-bit"),
    "model.tiny_hidden": Range(COUNT),
    "model.tiny_layers": Range(COUNT),
    "model.tiny_heads": Range(COUNT),
    "model.tiny_vocab": Range("[300, inf)", "256 bytes and the agent tags"),
    "model.tiny_intermediate": Range("[0, inf)", "0: 2 x tiny_hidden"),
    "model.tiny_kv_heads": Range("[0, inf)", "0: tiny_heads"),
    "model.tiny_vocab_rows": Range("[0, inf)", "0: the tokenizer's size"),
    "data.toy.seed": Range(NONNEG),
    "data.toy.num_people": Range(NONNEG),
    "data.toy.num_cities": Range(COUNT),
    "data.toy.num_countries": Range(COUNT),
    "data.toy.num_universities": Range(NONNEG),
    "data.toy.num_companies": Range(NONNEG),
    "data.toy.num_bands": Range(NONNEG),
    "data.toy.twin_fraction": Range(UNIT),
    "data.toy.distractor_fraction": Range(UNIT),
    "data.toy.married_fraction": Range(UNIT),
    "data.toy.num_questions": Range(COUNT),
    "data.toy.min_hops": Range("[1, 3]", "at most data.toy.max_hops"),
    "data.toy.max_hops": Range("[1, 3]"),
    "data.toy.test_fraction": Range("[0, 1)"),
    "data.max_prompt_tokens": Range(COUNT),
    "retrieval.topk": Range(COUNT),
    "retrieval.max_passage_tokens": Range(COUNT),
    "retrieval.batch_size": Range(COUNT),
    "retrieval.batch_timeout_ms": Range(NONNEG),
    "retrieval.num_shards": Range(NONNEG, "0: every visible GPU"),
    "retrieval.round_cadence_ms": Range(NONNEG),
    "rollout.n_samples": Range(COUNT),
    "rollout.temperature": Range(POS, "training divides the logits by it; greedy decoding is evaluation's"),
    "rollout.top_p": Range("(0, 1]"),
    "rollout.top_k": Range(COUNT, "-1: off", also=(-1,)),
    "rollout.max_turns": Range(COUNT),
    "rollout.max_action_tokens": Range(COUNT),
    "rollout.max_obs_tokens": Range(COUNT),
    "rollout.max_response_tokens": Range(COUNT),
    "rollout.gpu_memory_utilization": Range(UNIT, "0: auto"),
    "rollout.memory_margin_gib": Range(NONNEG),
    "rollout.tensor_parallel": Range(COUNT),
    "rollout.proceed.fraction": Range("(0, 1]"),
    "rollout.proceed.tau": Range("[0, 10]", "the process critic scores 0-10"),
    "rollout.proceed.max_rewinds": Range(NONNEG),
    "judges.temperature": Range(NONNEG, "0: greedy"),
    "judges.retry_temperature": Range(NONNEG, "0: greedy, a re-ask then repeats the same text"),
    "judges.max_tokens": Range(COUNT),
    "judges.concurrency": Range(COUNT),
    "judges.timeout_s": Range(POS),
    "judges.oracle_noise": Range(UNIT),
    "credit.lambda_f": Range(UNIT),
    "credit.format_bonus": Range(NONNEG),
    "credit.eps": Range(POS, "0 divides by zero in a group of equal rewards"),
    "credit.gamma": Range(UNIT),
    "credit.lam": Range(UNIT),
    "credit.kl_in_reward": Range(NONNEG),
    "credit.critic.retries": Range(NONNEG),
    "credit.criticsearch.alpha": Range(UNIT),
    "credit.criticsearch.eps_c": Range(POS),
    "credit.cwgrpo.alpha": Range("[0, inf]", "inf: p / sum p"),
    "credit.pica.s_step": Range(NONNEG),
    "credit.pica.s_out": Range(NONNEG),
    "credit.pica.lambda_p": Range(NONNEG),
    "credit.pica.alpha_p": Range(POS),
    "credit.pica.penalty_from_turn": Range(COUNT, "turns count from 1"),
    "credit.pica.hazard_bias": Range(UNIT),
    "credit.pica.f_clamp": Range("(0, 0.5)", "f is clamped to [f_clamp, 1 - f_clamp] before the log"),
    "credit.dynamic_sampling.max_refill_rounds": Range(NONNEG),
    "loss.clip_low": Range("[0, 1)"),
    "loss.clip_high": Range(NONNEG),
    "loss.dual_clip": Range("(1, inf)", "null: off"),
    "loss.kl_coef": Range(NONNEG),
    "loss.kl_clamp": Range(POS),
    "loss.entropy_coef": Range(NONNEG),
    "loss.value_clip": Range(POS),
    "loss.vf_coef": Range(NONNEG),
    "optim.lr": Range(POS),
    "optim.critic_lr": Range(POS),
    "optim.weight_decay": Range(NONNEG),
    "optim.betas": Range("[0, 1)", "each of the two"),
    "optim.warmup_ratio": Range("[0, 1)"),
    "optim.critic_warmup_ratio": Range("[0, 1)", "or null: optim.warmup_ratio"),
    "optim.grad_clip": Range("(0, inf]", "inf: no clipping"),
    "optim.total_steps": Range(NONNEG),
    "optim.batch_prompts": Range(COUNT),
    "optim.mini_batch_prompts": Range(COUNT),
    "optim.micro_batch_tokens": Range(COUNT),
    "optim.ppo_epochs": Range(COUNT),
    "distributed.shard_size": Range(COUNT, "-1: all ranks", also=(-1,)),
    "logging.log_every": Range(COUNT),
    "logging.checkpoint_every": Range(NONNEG, "0: only at the end"),
    "logging.keep_checkpoints": Range(NONNEG, "0: all"),
    "warmstart.epochs": Range(COUNT),
    "warmstart.lr": Range(POS),
    "warmstart.batch_size": Range(COUNT),
    "warmstart.questions": Range(NONNEG, "0: all"),
    "warmstart.seed": Range("[0, 4294967296)", "numpy seeds are 32-bit"),
    "eval.seed": Range("[0, 4294967296)", "numpy seeds are 32-bit"),
    "eval.questions": Range(NONNEG, "0: no evaluation"),
    "eval.every": Range(NONNEG, "0: only before and after training"),
    "guard.max_kl": Range("(0, inf]", "inf: off"),
    "guard.max_grad_norm": Range("(0, inf]", "inf: off"),
    "guard.min_reward": Range("[-inf, inf)", "-inf: off"),
    "guard.after_step": Range(NONNEG),
    "guard.max_rollbacks": Range(NONNEG),
}
_INT64 = 2 ** 63  # ints end up in tensors and numpy arrays


@functools.lru_cache(maxsize=None)
def numeric_keys(cls, prefix: str = "") -> dict[str, type]:
    """``{dotted key: int or float}`` of every number in the config tree (Optional ones and lists of numbers too)."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(numeric_keys(tp, f"{prefix}{f.name}."))
            continue
        inner = tp
        if typing.get_origin(inner) is typing.Union:  # Optional[float]
            inner = next(a for a in typing.get_args(inner) if a is not type(None))
        if typing.get_origin(inner) is list:  # list[float]: each element in the range
            inner = typing.get_args(inner)[0]
        if inner in (int, float):
            out[prefix + f.name] = inner
    return out


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg, origins: Mapping[str, str]) -> None:
    """Every number of ``cfg`` lies in its ``RANGES`` entry; the error names the key and where it was set."""
    for key in numeric_keys(type(cfg)):
        value, rng = _get(cfg, key), RANGES.get(key)
        if value is None or rng is None:
            continue
        where = f"{origins[key]}: " if key in origins else ""
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ConfigError(f"{where}{key} must hold numbers, got {value!r}")
            if isinstance(x, int) and not -_INT64 <= x < _INT64:
                raise ConfigError(f"{where}{key}={x} does not fit in 64 bits; {key} {rng.describe()}")
            if x not in rng:
                raise ConfigError(f"{where}{key} {rng.describe()}, got {value!r}")


def check_rules(cfg) -> None:
    """The rules between keys that no single range expresses."""
    o, d, r = cfg.optim, cfg.data, cfg.retrieval
    checks = [
        (o.batch_prompts % o.mini_batch_prompts == 0,
         f"optim.batch_prompts={o.batch_prompts} must be a multiple of optim.mini_batch_prompts={o.mini_batch_prompts}"),
        (len(o.betas) == 2, f"optim.betas must be two numbers in [0, 1), got {o.betas!r}"),
        (d.source == "toy" or d.train_path, f"data.train_path is required for data.source={d.source}"),
        (cfg.model.policy != "tiny" or cfg.model.tiny_hidden % cfg.model.tiny_heads == 0,
         f"model.tiny_hidden={cfg.model.tiny_hidden} must be a multiple of model.tiny_heads={cfg.model.tiny_heads}"),
        (cfg.model.policy != "tiny" or cfg.model.tiny_heads % (cfg.model.tiny_kv_heads or cfg.model.tiny_heads) == 0,
         f"model.tiny_heads={cfg.model.tiny_heads} must be a multiple of model.tiny_kv_heads={cfg.model.tiny_kv_heads}"),
        (cfg.distributed.engine == "fsdp2" or cfg.distributed.shard_size == -1,
         f"distributed.shard_size={cfg.distributed.shard_size} applies to distributed.engine=fsdp2 only "
         "(DeepSpeed ZeRO shards over all ranks); leave it at -1"),
        (cfg.rollout.tensor_parallel == 1,
         f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}: each rank's rollout engine runs in the trainer's "
         "process on that rank's GPU (the hf engine has no tensor parallelism; vLLM would run tensor-parallel "
         "workers in other processes, where the streamed weight sync cannot reach them); use 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if r.backend == "local" and r.index is None:
        check_index(r)  # build_index=never without an index
    if d.source == "toy":
        from fastcredit.data.toyworld import _check_config

        try:
            _check_config(d.toy)
        except ValueError as exc:  # "toy world: num_cities (3) must be ..." names data.toy's keys
            raise ConfigError(f"data.toy: {str(exc).removeprefix('toy world: ')}") from None


# What each judge kind of an estimator's Needs asks of the config: (unmet?, what to set).
_JUDGE_SETTINGS = {
    "critic": (lambda c: c.judges.backend == "none", "a critic: set judges.backend to colocated, http or oracle"),
    "round_judge": (lambda c: c.judges.backend == "none", "a judge: set judges.backend to colocated, http or oracle"),
    "prm": (lambda c: not c.judges.prm, "a process reward model: set judges.prm"),
}


def check_needs(cfg) -> None:
    """What the chosen estimator declared it needs (``fastcredit.credit.estimator_needs``) is configured."""
    from fastcredit.credit.registry import estimator_needs

    est = cfg.credit.estimator
    needs = estimator_needs(est)
    if needs.judge is not None:
        unmet, what = _JUDGE_SETTINGS[needs.judge]
        if unmet(cfg):
            raise ConfigError(f"credit.estimator={est} needs {what}")
    if needs.proceed_rollout and not cfg.rollout.proceed.enabled:
        raise ConfigError(f"credit.estimator={est} needs rollout.proceed.enabled=true")


def check_config(cfg, origins: Optional[Mapping[str, str]] = None) -> None:
    """Ranges (``origins``: key → where it was set, named in the message), the rules between keys, the estimator's
    needs."""
    check_ranges(cfg, origins or {})
    check_rules(cfg)
    check_needs(cfg)


def _paths(cfg, part: str) -> list[tuple[str, Optional[str], str]]:
    """``(key, path or None, what belongs there)`` of the local paths ``part`` of the config reads."""
    m, d, r, j = cfg.model, cfg.data, cfg.retrieval, cfg.judges
    if part == "model":
        return [("model.policy", None if m.policy in ("tiny", "smollm2") else m.policy,
                 "a local Hugging Face folder, 'tiny' or 'smollm2'"),
                ("model.tokenizer", m.tokenizer, "a local tokenizer folder, or null: the policy's")]
    if part == "data":
        files = "a Search-R1 parquet or FlashRAG jsonl file, or a folder holding <split>.parquet / <split>.jsonl"
        real = d.source != "toy"
        return [("data.train_path", d.train_path if real else None, files),
                ("data.test_path", d.test_path if real else None, files),
                ("retrieval.corpus", r.corpus, "the corpus jsonl, Search-R1 format")]
    if part == "retrieval":
        local = r.backend == "local"
        return [("retrieval.corpus", r.corpus if local else None, "the corpus jsonl, Search-R1 format"),
                ("retrieval.encoder", r.encoder if local and r.encoder != "minilm" else None,
                 "'minilm' or a local Hugging Face encoder folder")]
    if part == "judges":
        prm = j.prm if j.prm and j.prm != "oracle" and not j.prm.startswith(("http://", "https://")) else None
        return [("judges.model", j.model if j.backend == "colocated" else None,
                 "a local Hugging Face folder for judges.backend=colocated"),
                ("judges.prm", prm, "a PRM folder python -m fastcredit.prm.train exported, 'oracle', or the URL of "
                                    "PiCA's reward server")]
    raise ValueError(f"unknown part {part!r}; valid: model, data, retrieval, judges")


def check_paths(cfg, *parts: str) -> None:
    """The local files and folders ``parts`` of ``cfg`` name exist (model, data, retrieval, judges; none given:
    all), so a wrong path fails here naming its key, before a library takes it for a Hugging Face hub id."""
    for part in parts or ("model", "data", "retrieval", "judges"):
        for key, path, what in _paths(cfg, part):
            if path is not None and not os.path.exists(path):
                raise ConfigPathError(f"{key}: {path} does not exist ({what})")
        if part == "retrieval" and cfg.retrieval.backend == "local":
            check_index(cfg.retrieval)


def check_index(r) -> None:
    """``retrieval.build_index`` (``r``: the retrieval section): an index nothing will build must exist."""
    if r.index is None and r.build_index == "never":
        raise ConfigError("retrieval.build_index=never needs retrieval.index: the file or folder "
                          "python -m fastcredit.retrieval.build wrote (or Search-R1's e5_Flat.index)")
    if r.index is None or r.build_index == "missing" or os.path.exists(r.index):
        return
    out = os.path.splitext(r.index)[0] if r.index.endswith(".index") else r.index
    flags = [("--encoder", r.encoder, "minilm"), ("--pooling", r.pooling, "mean"), ("--index-type", r.index_type, "flat"),
             ("--query-prefix", r.query_prefix, ""), ("--passage-prefix", r.passage_prefix, "")]
    cmd = " ".join(["python -m fastcredit.retrieval.build", "--corpus", shlex.quote(r.corpus or "CORPUS.jsonl"),
                    "--out", shlex.quote(out)] + [f"{f} {shlex.quote(v)}" for f, v, default in flags if v != default])
    raise ConfigPathError(
        f"retrieval.index: {r.index} does not exist, and with retrieval.build_index={r.build_index} nothing builds it. "
        f"Build it first, `{cmd}`, and set retrieval.index={out}; or set retrieval.build_index=missing to build it "
        "at that path when the run starts")
