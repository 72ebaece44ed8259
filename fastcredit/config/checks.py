"""What ``fastcredit.config.validate`` checks beyond each number's range: the rules between keys, and the paths.

    check_config(cfg, origins)           # ranges and the rules between keys; from load_config
    check_paths(cfg, "model")            # the local folders a part of the config names exist; before loading
    raise_broken([betas_rule(cfg.optim), shard_size_rule(cfg.distributed)])   # rules another tree shares

Each number's range is declared beside its field (``fastcredit.config.ranges``). What the chosen
estimator needs (a judge, a PRM, ProCeed rollouts) is checked by ``fastcredit.credit.needs``: this
package imports nothing else of fastcredit. No torch here.
"""
from __future__ import annotations

import os
import shlex
from typing import Iterable, Mapping, Optional

from fastcredit.config.errors import ConfigError, ConfigPathError
from fastcredit.config.ranges import check_ranges
from fastcredit.config.toy import check_toy_world

__all__ = ["ConfigError", "ConfigPathError", "Rule", "betas_rule", "check_config", "check_index", "check_paths",
           "check_rules", "raise_broken", "shard_size_rule", "tiny_heads_rule"]

Rule = tuple[bool, str]  # (holds, the message when it does not)


def betas_rule(o) -> Rule:
    """``optim.betas`` holds two numbers (``o``: an optim section; each one's range is declared with the field)."""
    return len(o.betas) == 2, f"optim.betas must be two numbers in [0, 1), got {o.betas!r}"


def tiny_heads_rule(m, tiny: bool) -> Rule:
    """A 'tiny' model's width splits evenly over its heads (``m``: a model section; ``tiny``: the run builds one)."""
    return (not tiny or m.tiny_hidden % m.tiny_heads == 0,
            f"model.tiny_hidden={m.tiny_hidden} must be a multiple of model.tiny_heads={m.tiny_heads}")


def shard_size_rule(d) -> Rule:
    """``distributed.shard_size`` is FSDP2's (``d``: the distributed section)."""
    return (d.engine == "fsdp2" or d.shard_size == -1,
            f"distributed.shard_size={d.shard_size} applies to distributed.engine=fsdp2 only (DeepSpeed ZeRO shards "
            "over all ranks); leave it at -1")


def lookup_turns_rule(cfg) -> Rule:
    """A lookup world's longest turn budget (``max_k + slack`` searches and the answer) fits in
    ``rollout.max_turns``."""
    d = cfg.data
    if d.source != "toy" or d.toy.kind != "lookup":
        return True, ""
    need = d.toy.lookup.max_k + d.toy.lookup.slack + 1
    return (cfg.rollout.max_turns >= need,
            f"rollout.max_turns={cfg.rollout.max_turns} is too few turns for data.toy.lookup.max_k="
            f"{d.toy.lookup.max_k}: a question about {d.toy.lookup.max_k} entities has a budget of "
            f"{d.toy.lookup.max_k} + data.toy.lookup.slack={d.toy.lookup.slack} searches and the answer; set "
            f"rollout.max_turns to at least {need}")


def raise_broken(rules: Iterable[Rule]) -> None:
    """A ConfigError with the message of the first rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ConfigError(message)


def check_rules(cfg) -> None:
    """The rules between keys that no single range expresses."""
    o, d, r, m = cfg.optim, cfg.data, cfg.retrieval, cfg.model
    raise_broken([
        (o.batch_prompts % o.mini_batch_prompts == 0,
         f"optim.batch_prompts={o.batch_prompts} must be a multiple of "
         f"optim.mini_batch_prompts={o.mini_batch_prompts}"),
        betas_rule(o),
        (d.source == "toy" or d.train_path, f"data.train_path is required for data.source={d.source}"),
        (d.source == "toy" or cfg.warmstart.detour_fraction == 0,
         f"warmstart.detour_fraction={cfg.warmstart.detour_fraction} needs data.source=toy (detours search the toy "
         f"world's twins and relations), got data.source={d.source}"),
        (d.source != "toy" or d.toy.kind == "chain" or cfg.warmstart.detour_fraction == 0,
         f"warmstart.detour_fraction={cfg.warmstart.detour_fraction} is the chain world's (detours search twins and "
         "other relations); the lookup world's demonstrator errs through warmstart.waste_prob and "
         "warmstart.misquery_prob"),
        ((d.source == "toy" and d.toy.kind == "lookup")
         or cfg.warmstart.waste_prob == cfg.warmstart.misquery_prob == 0,
         f"warmstart.waste_prob={cfg.warmstart.waste_prob} and warmstart.misquery_prob="
         f"{cfg.warmstart.misquery_prob} need data.source=toy with data.toy.kind=lookup (the lookup world's "
         "demonstrator)"),
        (cfg.warmstart.waste_prob + cfg.warmstart.misquery_prob <= 1,
         f"warmstart.waste_prob ({cfg.warmstart.waste_prob}) and warmstart.misquery_prob "
         f"({cfg.warmstart.misquery_prob}) add up to more than 1"),
        lookup_turns_rule(cfg),
        tiny_heads_rule(m, m.policy == "tiny"),
        (m.policy != "tiny" or m.tiny_heads % (m.tiny_kv_heads or m.tiny_heads) == 0,
         f"model.tiny_heads={m.tiny_heads} must be a multiple of model.tiny_kv_heads={m.tiny_kv_heads}"),
        shard_size_rule(cfg.distributed),
        (cfg.rollout.tensor_parallel == 1,
         f"rollout.tensor_parallel={cfg.rollout.tensor_parallel}: each rank's rollout engine runs in the trainer's "
         "process on that rank's GPU (the hf engine has no tensor parallelism; vLLM would run tensor-parallel "
         "workers in other processes, where the streamed weight sync cannot reach them); use 1"),
        (cfg.rollout.max_staleness == 0 or cfg.distributed.placement == "split",
         f"rollout.max_staleness={cfg.rollout.max_staleness} needs distributed.placement=split: colocated ranks "
         "roll out with the weights they just trained (staleness 0)"),
        (not cfg.rollout.partial or cfg.distributed.placement == "split",
         "rollout.partial=true needs distributed.placement=split (colocated weights change only between steps)"),
        (cfg.distributed.placement == "colocated" or cfg.distributed.engine == "fsdp2",
         "distributed.placement=split trains with distributed.engine=fsdp2 (DeepSpeed's engine spans every rank "
         "of the job, rollout ranks included); use fsdp2 or placement=colocated"),
        # only an explicit false is known to keep the state before the run starts; auto decides at start from the
        # GPU (fastcredit.trainer.memory.offload), and when it keeps the state the memory plan gives vLLM's share
        (cfg.distributed.offload_state is not False or not cfg.distributed.colocate or cfg.rollout.engine != "vllm"
         or cfg.rollout.gpu_memory_utilization > 0,
         "distributed.offload_state=false with rollout.engine=vllm needs a fixed rollout.gpu_memory_utilization "
         "(0 sizes vLLM's share from what is free before the first update, before the optimizer state the kept "
         "training state will hold exists); distributed.offload_state=auto sizes it from the memory plan"),
        (cfg.distributed.placement == "colocated" or cfg.distributed.shard_size == -1,
         f"distributed.shard_size={cfg.distributed.shard_size}: a split placement shards over its training ranks "
         "only (a 1-D mesh); leave it at -1"),
    ])
    if r.backend == "local" and r.index is None:
        check_index(r)  # build_index=never without an index
    if d.source == "toy":
        check_toy_world(d.toy, "data.toy")


def check_config(cfg, origins: Optional[Mapping[str, str]] = None) -> None:
    """Every number in its field's range (``origins``: key → where it was set, named in the message), then the
    rules between keys."""
    check_ranges(cfg, origins or {})
    check_rules(cfg)


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
    flags = [("--encoder", r.encoder, "minilm"), ("--pooling", r.pooling, "mean"),
             ("--index-type", r.index_type, "flat"), ("--query-prefix", r.query_prefix, ""),
             ("--passage-prefix", r.passage_prefix, "")]
    cmd = " ".join(["python -m fastcredit.retrieval.build", "--corpus", shlex.quote(r.corpus or "CORPUS.jsonl"),
                    "--out", shlex.quote(out)]
                   + [f"{f} {shlex.quote(v)}" for f, v, default in flags if v != default])
    raise ConfigPathError(
        f"retrieval.index: {r.index} does not exist, and with retrieval.build_index={r.build_index} nothing "
        f"builds it. Build it first, `{cmd}`, and set retrieval.index={out}; or set retrieval.build_index=missing "
        "to build it at that path when the run starts")
