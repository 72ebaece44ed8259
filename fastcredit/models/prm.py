"""PiCA's process reward model: a causal-LM backbone with a scalar head read at the placeholders, its loss, its folder.

    lm, tok = backbone("tiny" or a HF folder), tokenizer;  add_placeholder(tok, lm, "<|vision_start|>")
    model = PRMModel(lm)                                  # f = σ(head(h)) at every placeholder of a packed row
    z_P = model(x)                                        # logits at x.pred_N (fastcredit.models.prm_inputs.pack)
    loss_B, parts = prm_loss(z_P, cu_P, outcome_B, pivot_P, lambda_g=1.0, tau_g=0.1)
    save_prm(folder, lm, head, tok, meta);  model, tok, meta = load_prm(folder)

The loss (docs/methods.md §6; PiCA Eqs. 8–10), per trajectory with placeholders ``0..T``:

    L_final = BCE(f(T), l) = −[l·log σ(z_T) + (1 − l)·log σ(−z_T)]
    L_gold  = −Σ_{t ∈ pivots} log σ((log f(t) − log f(t − 1)) / τg)      (t ≥ 1: pivots are turns)
    L       = L_final + λg·L_gold

PiCA writes ``L_gold = −Σ log g_t`` with ``g_t = f(t)/f(t−1) − 1``, undefined for ``g_t ≤ 0``;
the form above rewards a positive log-gain at each pivot, is defined everywhere, and tends
to the same optimum (a pivot's ``f`` rises). Everything is computed from the logits
(``log f = logsigmoid(z)``), so no clamp is needed in training.

A PRM folder is a Hugging Face causal-LM folder (the backbone, loadable by transformers and
vLLM) with the tokenizer that holds the placeholder, plus ``prm_head.safetensors``
(``weight [1, H]``, ``bias [1]``) and ``prm.json`` (placeholder, its id, the token budget).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn.functional as F

from fastcredit.models.packed import ValueModel

PRM_META = "prm.json"
PRM_HEAD = "prm_head.safetensors"
FORMAT = "fastcredit-prm"


class PRMModel(ValueModel):
    """The backbone and a scalar head (zero-initialised: ``f = 0.5`` everywhere before training); ``forward``
    returns the head's logit at each placeholder (``x.pred_N``, float32): the value model's forward, read at the
    placeholders."""


def add_placeholder(tokenizer, lm, placeholder: str) -> int:
    """The placeholder's id, adding it to the tokenizer as a special token (and a row to the backbone's
    embeddings when the vocabulary is full) when it is not already one token."""
    from fastcredit.models.prm_inputs import require_placeholder

    pid = require_placeholder(tokenizer, placeholder)
    if pid is not None:
        return pid
    tokenizer.add_special_tokens({"additional_special_tokens": [placeholder]})
    pid = require_placeholder(tokenizer, placeholder)
    if pid is None:
        raise ValueError(f"could not add {placeholder!r} to the tokenizer as one token")
    if pid >= lm.get_input_embeddings().weight.shape[0]:
        lm.resize_token_embeddings(len(tokenizer))
    return pid


def prm_loss(z_P: torch.Tensor, cu_P: torch.Tensor, outcome_B: torch.Tensor, pivot_P: torch.Tensor,
             lambda_g: float, tau_g: float) -> tuple[torch.Tensor, dict]:
    """Per-trajectory loss ``[B]`` (float32, differentiable) and its parts (``final_B``, ``gold_B``, detached).

    ``z_P``: head logits at every placeholder, trajectory by trajectory; ``cu_P`` ``[B+1]``: trajectory ``b``'s
    placeholders are ``cu_P[b]:cu_P[b+1]`` (the first is the question's); ``pivot_P``: 1 at a pivot turn's
    placeholder (never at a question's)."""
    cu = cu_P.to(z_P.device)
    B = cu.numel() - 1
    counts = cu[1:] - cu[:-1]
    traj_P = torch.repeat_interleave(torch.arange(B, device=z_P.device), counts)
    last_B = cu[1:] - 1
    final_B = F.binary_cross_entropy_with_logits(z_P[last_B], outcome_B.to(z_P), reduction="none")
    logf_P = F.logsigmoid(z_P)
    first_P = torch.zeros_like(z_P, dtype=torch.bool)
    first_P[cu[:-1]] = True
    gain_P = torch.where(first_P, torch.zeros_like(logf_P), logf_P - torch.roll(logf_P, 1))
    piv = pivot_P.to(z_P.device).bool() & ~first_P
    gold_P = torch.where(piv, -F.logsigmoid(gain_P / tau_g), torch.zeros_like(gain_P))
    gold_B = torch.zeros(B, dtype=z_P.dtype, device=z_P.device).index_add_(0, traj_P, gold_P)
    return final_B + lambda_g * gold_B, {"final_B": final_B.detach(), "gold_B": gold_B.detach()}


def hazards(f0_B: torch.Tensor, f_S: torch.Tensor, traj_S: torch.Tensor, t_S: torch.Tensor) -> torch.Tensor:
    """The hazard form ``h_t = 1 − f(t)/f(t−1)`` clamped to ``[0, 1]`` (``pica.step_reward=linear``), ``[S]``."""
    prev = torch.where(t_S == 1, f0_B[traj_S], torch.roll(f_S, 1))
    return (1.0 - f_S / prev.clamp_min(1e-12)).clamp(0.0, 1.0)


def save_prm(folder: str, lm, head: torch.nn.Linear, tokenizer, placeholder: str, max_tokens: int,
             extra: Optional[dict] = None) -> str:
    """Write a PRM folder (see the module docstring) atomically: into ``folder.tmp``, then renamed."""
    import shutil

    from safetensors.torch import save_file

    tmp = folder.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    lm.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    save_file({"weight": head.weight.detach().float().cpu().contiguous(),
               "bias": head.bias.detach().float().cpu().contiguous()}, os.path.join(tmp, PRM_HEAD))
    meta = {"format": FORMAT, "version": 1, "placeholder": placeholder,
            "placeholder_id": int(tokenizer.convert_tokens_to_ids(placeholder)), "max_tokens": int(max_tokens),
            "hidden_size": int(head.weight.shape[1]), "output": "f = sigmoid(head(h)) at each placeholder",
            **(extra or {})}
    with open(os.path.join(tmp, PRM_META), "w") as fh:
        json.dump(meta, fh, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def read_prm_meta(folder: str) -> dict:
    """``prm.json`` of a PRM folder; a ValueError names what is missing or wrong."""
    path = os.path.join(folder, PRM_META)
    if not os.path.isdir(folder):
        raise ValueError(f"judges.prm={folder}: no such folder (train one with python -m fastcredit.prm.train)")
    if not os.path.isfile(path):
        raise ValueError(f"{folder} is not a PRM folder: it has no {PRM_META} (python -m fastcredit.prm.train "
                         "exports one)")
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from exc
    for key in ("format", "placeholder", "placeholder_id", "max_tokens"):
        if key not in meta:
            raise ValueError(f"{path}: missing key {key!r}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{path}: format {meta['format']!r} is not {FORMAT!r}")
    if not os.path.isfile(os.path.join(folder, PRM_HEAD)):
        raise ValueError(f"{folder}: missing {PRM_HEAD} (the PRM's head)")
    return meta


def load_prm(folder: str, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[PRMModel, object, dict]:
    """``(model, tokenizer, meta)`` of a PRM folder, frozen, in ``dtype`` on ``device``."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fastcredit.data.tokenizer import load_tokenizer

    meta = read_prm_meta(folder)
    tok = load_tokenizer(folder)
    if tok.convert_tokens_to_ids(meta["placeholder"]) != meta["placeholder_id"]:
        raise ValueError(f"{folder}: its tokenizer maps {meta['placeholder']!r} to "
                         f"{tok.convert_tokens_to_ids(meta['placeholder'])}, {PRM_META} says {meta['placeholder_id']}")
    lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)
    model = PRMModel(lm)
    head = load_file(os.path.join(folder, PRM_HEAD))
    if tuple(head["weight"].shape) != tuple(model.value_head.weight.shape):
        raise ValueError(f"{folder}/{PRM_HEAD}: head of shape {tuple(head['weight'].shape)}, the backbone needs "
                         f"{tuple(model.value_head.weight.shape)}")
    model.value_head.load_state_dict(head)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, tok, meta
