"""The policy and its tokenizer, from the config: what every command that trains, evaluates, labels or prepares
reads its model with.

    tokenizer = run_tokenizer(cfg, data, out_dir, rank)   # tiny: a BPE trained once over the corpus (rank 0)
    lm = load_policy(cfg, tokenizer, info)                 # fp32 master weights on the CPU (meta off rank 0)
    ref = frozen_copy(lm, torch.bfloat16)                  # a frozen copy (reference policy, an engine's weights)

A saved folder's own tokenizer, by the class it names, is ``fastcredit.data.tokenizer.load_tokenizer``. The paths
the config names are checked before these run (``fastcredit.config.checks.check_paths``, once, by the command).
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from fastcredit.config import TrainConfig
from fastcredit.models.smollm2 import smollm2_files
from fastcredit.runtime.files import built_from, mark_built, wait_for_built


def run_tokenizer(cfg: TrainConfig, data, out_dir: str, rank: int = 0):
    """The policy's tokenizer; ``tiny`` trains a byte-level BPE over ``data``'s corpus and prompts into
    ``out_dir/tokenizer`` (rank 0, once; the other ranks wait for it)."""
    from transformers import AutoTokenizer

    if cfg.model.policy != "tiny":
        if cfg.model.policy == "smollm2":
            folder, gguf = smollm2_files()
            return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.policy, local_files_only=True)
    if cfg.model.tokenizer:
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer, local_files_only=True)
    folder = os.path.join(out_dir, "tokenizer")
    corpus = os.stat(data.corpus)
    key = {"vocab": cfg.model.tiny_vocab, "template": cfg.data.prompt_template, "corpus": data.corpus,
           "corpus_bytes": corpus.st_size, "corpus_mtime_ns": corpus.st_mtime_ns, "train_questions": len(data.train)}
    held_out = held_out_passages(data)
    if held_out:
        key["held_out_passages"] = len(held_out)
    if rank == 0 and not built_from(folder, key):
        from fastcredit.data.loaders import iter_corpus
        from fastcredit.data.prompts import build_prompt
        from fastcredit.data.tokenizer import build_tiny_tokenizer

        texts = [f'Doc 1(Title: "{t}") {x}' for pid, t, x in iter_corpus(data.corpus) if pid not in held_out]
        texts += [build_prompt(ex.question, cfg.data.prompt_template) for ex in data.train]
        build_tiny_tokenizer(texts, cfg.model.tiny_vocab, folder)
        mark_built(folder, key)
    wait_for_built(folder, key)
    return AutoTokenizer.from_pretrained(folder)


def held_out_passages(data) -> set:
    """The lookup world's passages of held-out entities (those only held-out questions ask about), which the tiny
    tokenizer is not fitted to: it then holds no token that only a held-out passage shows, as a real tokenizer was
    never fitted to an entity it never saw. Empty for any other data (the chain world's held-out questions share
    its entities)."""
    from fastcredit.data.lookup import is_lookup
    from fastcredit.data.toyqa import gold_fact_passages

    if not data.test or not all(is_lookup(ex) for ex in data.test):
        return set()

    def cited(examples) -> set:
        return {pid for ex in examples for ids in gold_fact_passages(ex) for pid in ids}

    return cited(data.test) - cited(data.train)


def loads_on_rank0(cfg: TrainConfig, info) -> bool:
    """Whether a policy read from files is read on rank 0 only (torchrun with FSDP2): the other ranks build it on
    the meta device and FSDP2 fills their shards from rank 0 (``fastcredit.distributed.from_rank0``). A tiny
    policy is built in code on every rank; DeepSpeed loads on every rank."""
    # a split placement's training ranks each read the file (their group is not the job's, which the broadcast uses)
    return info is not None and info.distributed and info.group is None and cfg.distributed.engine == "fsdp2" \
        and cfg.model.policy != "tiny"


def load_policy(cfg: TrainConfig, tokenizer, info=None, meta: bool = False) -> torch.nn.Module:
    """The policy's HF causal LM in float32 on the CPU: the master weights the training engine shards onto the
    device (``model.dtype`` is the compute dtype there, not the storage dtype). Under :func:`loads_on_rank0`,
    ranks other than 0 get the same model on the meta device (no memory); so does ``meta`` (a policy read from
    files, whose weights come from elsewhere: a split placement's vLLM rollout ranks need its architecture only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    if m.policy != "tiny" and (meta or (loads_on_rank0(cfg, info) and info.rank != 0)):
        folder, gguf = smollm2_files() if m.policy == "smollm2" else (m.policy, None)
        config = AutoConfig.from_pretrained(folder, local_files_only=True, **({"gguf_file": gguf} if gguf else {}))
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32,
                                                  attn_implementation=m.attn_impl if m.policy != "smollm2" else None)
        return lm.float()
    if m.policy == "tiny":
        from fastcredit.models.tiny import build_tiny_policy

        # a warm-started policy is initialised by the warm start's seed: it is part of the warm start
        seed = cfg.warmstart.seed_for(cfg.seed) if cfg.warmstart.enabled else cfg.seed
        lm = build_tiny_policy(tokenizer, hidden=m.tiny_hidden, layers=m.tiny_layers, heads=m.tiny_heads, seed=seed,
                               intermediate=m.tiny_intermediate, kv_heads=m.tiny_kv_heads, vocab_rows=m.tiny_vocab_rows)
    elif m.policy == "smollm2":
        from fastcredit.models.smollm2 import CACHE, prepare_smollm2

        # de-quantised from the package's GGUF once per machine (20-60 s), then read as a plain fp32 folder; NOTE: not
        # a bare from_pretrained(gguf_file=...): transformers marks that model quantized and it refuses .float()
        lm = AutoModelForCausalLM.from_pretrained(prepare_smollm2(CACHE), torch_dtype=torch.float32,
                                                  local_files_only=True, attn_implementation=m.attn_impl)
    else:
        lm = AutoModelForCausalLM.from_pretrained(m.policy, torch_dtype=torch.float32, local_files_only=True,
                                                  attn_implementation=m.attn_impl)
    return lm.float()


def policy_config(lm):
    """A copy of ``lm``'s HF config naming its class (``architectures``): the architecture an engine is built for
    (vLLM reads the class from it; a model built in code leaves it unset)."""
    config = copy.deepcopy(lm.config)
    config.architectures = [type(lm).__name__]
    return config


def frozen_copy(lm, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """A frozen copy (reference policy, or the HF engine's own weights), cast to ``dtype`` when given."""
    ref = copy.deepcopy(lm)
    ref.requires_grad_(False)
    return (ref if dtype is None else ref.to(dtype)).eval()
