"""Padding-free attention for packed sequences: block-diagonal causal attention over one ``[1, T]`` row.

The actor packs a micro-batch's sequences back to back into one row (``fastcredit.models.packed``):
position ids restart at 0 for each sequence and ``cu_seqlens`` ``[B+1]`` bound them. The
decoder gets ``position_ids`` and transformers' flash-attention keyword arguments
(``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``); an HF decoder
hands its ``**kwargs`` through every layer (and through activation-checkpointing wrappers,
which save keyword arguments for the recompute) to the attention function of each layer,
so no token attends across sequences and no pad token is ever computed.

Two backends, both through transformers' own extension points (the model's
``config._attn_implementation`` names an entry of ``AttentionInterface`` and of
``AttentionMaskInterface``):

* ``flash_attention_2`` (CUDA, half precision, ``flash_attn`` importable, or whenever the
  model was loaded with a flash implementation): transformers' varlen path, which calls
  ``flash_attn_varlen_func`` with the cumulative lengths as given (no unpadding step).
* ``fastcredit_varlen`` (:data:`VARLEN`; the CPU, fp32 on CUDA, CUDA without flash-attn):
  registered here. The attention function runs PyTorch SDPA with ``is_causal=True`` once
  per sequence (the cost is ``Σ L_b²``, never ``T²``); the mask function returns ``None``
  for an unpadded single row, so transformers never builds a ``[T, T]`` mask. For any other
  call (padding masks, a KV cache, several rows) both functions are exactly ``sdpa``'s, so
  a model (or a copy of one) set to ``fastcredit_varlen`` still generates correctly.

:func:`use_packed_attention` picks the backend from the device and dtype the decoder will
compute in and sets it on that model only (``set_attn_implementation``: the model's own
config, shared by its layers; copies made earlier, e.g. the rollout engine's, keep theirs).
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

VARLEN = "fastcredit_varlen"


def _segment_bounds(cu_seq_lens_q, position_ids, query: torch.Tensor, attention_mask) -> Optional[list]:
    """Host-side sequence bounds ``[0, …, T]`` of an unpadded single row; None for any other call."""
    T = query.shape[2]
    if attention_mask is not None or query.shape[0] != 1:
        return None
    if cu_seq_lens_q is not None:  # the actor passes them on the host: no device sync here
        bounds = [int(b) for b in cu_seq_lens_q.tolist()]
        if bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seq_lens_q {bounds[:3]}…{bounds[-1]} does not tile the {T} packed tokens")
        return bounds
    if position_ids is None or position_ids.shape[-1] != T:
        return [0, T]
    # the same rule as transformers' find_packed_sequence_indices: a new sequence wherever the position does not
    # advance by one (one host sync; the actor never takes this path)
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(pos, prepend=pos[:1] - 1) != 1).view(-1).tolist()
    return (starts if starts and starts[0] == 0 else [0] + starts) + [T]


def varlen_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                             sliding_window: Optional[int] = None, cu_seq_lens_q: Optional[torch.Tensor] = None,
                             cu_seq_lens_k: Optional[torch.Tensor] = None, max_length_q: Optional[int] = None,
                             max_length_k: Optional[int] = None, position_ids: Optional[torch.Tensor] = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence: ``(out [1, T, H, D], None)``, transformers' layout.

    ``query`` ``[1, H, T, D]``, ``key`` / ``value`` ``[1, H_kv, T, D]`` (GQA: ``module.num_key_value_groups``
    query heads share a key head). Not an unpadded single row (a padding mask, a KV cache longer than
    the queries, several rows): ``sdpa_attention_forward`` unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    same = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or torch.equal(cu_seq_lens_k, cu_seq_lens_q)
    bounds = _segment_bounds(cu_seq_lens_q, position_ids, query, attention_mask) \
        if key.shape[2] == query.shape[2] and same else None
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, position_ids=position_ids, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if sliding_window is not None and max(lengths) > sliding_window:
        raise NotImplementedError(f"{VARLEN}: a packed sequence of {max(lengths)} tokens exceeds the sliding "
                                  f"window {sliding_window}; use flash_attention_2")
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    # split, not one slice per sequence: the backward then concatenates the pieces' gradients once,
    # where B slices would each allocate a zero gradient of the whole [1, H, T, D] input
    pieces = zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), lengths)
    outs = [F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal and n > 1, scale=scaling,
                                           enable_gqa=gqa) for q, k, v, n in pieces if n]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """None for an unpadded single row without a cache (the attention function bounds the sequences
    itself); otherwise the mask ``sdpa`` would get."""
    from transformers import masking_utils

    offsets_zero = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
    if attention_mask is None and batch_size == 1 and q_length == kv_length and offsets_zero:
        return None
    return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                   kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register :data:`VARLEN` with transformers' attention and mask interfaces (once; a no-op after)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_attention_forward)
    if VARLEN not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(VARLEN, varlen_mask)


def is_flash(impl: Optional[str]) -> bool:
    """A flash-attention implementation (``flash_attention_2`` / ``_3`` / a hub flash kernel)."""
    return bool(impl) and "flash" in impl


def _flash_attn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None)


def packed_attention_impl(current: Optional[str], device: torch.device, dtype: torch.dtype) -> str:
    """The attention implementation a packed forward runs: the model's flash implementation if it has
    one, ``flash_attention_2`` where flash-attn can run, else :data:`VARLEN`."""
    if is_flash(current):
        return current
    return "flash_attention_2" if _flash_attn_usable(device, dtype) else VARLEN


def attention_impl(lm: nn.Module) -> Optional[str]:
    """The name of the attention implementation ``lm``'s layers call (its config's ``_attn_implementation``)."""
    return lm.config._attn_implementation


def use_packed_attention(lm: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Set ``lm``'s attention to :func:`packed_attention_impl` (a no-op once set) and return its name."""
    register()
    current = attention_impl(lm)
    impl = packed_attention_impl(current, device, dtype)
    if impl != current:
        if hasattr(lm, "set_attn_implementation"):
            lm.set_attn_implementation(impl)
        if lm.config._attn_implementation != impl:  # a model transformers cannot switch: its config directly
            lm.config._attn_implementation = impl
    return impl


def packed_attention_kwargs(impl: str, cu_seqlens_cpu: torch.Tensor, max_seqlen: int,
                            device: torch.device) -> dict:
    """The decoder's keyword arguments for a packed row: the cumulative lengths on the host for
    :data:`VARLEN` (it slices with them), int32 on the device for flash-attention."""
    cu = cu_seqlens_cpu.to(torch.int32)
    if is_flash(impl):
        cu = cu.to(device, non_blocking=True)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(max_seqlen), "max_length_k": int(max_seqlen)}


def packed_positions(lengths: Sequence[int]) -> torch.Tensor:
    """int64 ``[sum(lengths)]``: 0, 1, …, L_b − 1 for each sequence, back to back."""
    L = torch.as_tensor(list(lengths), dtype=torch.int64)
    starts = torch.cumsum(L, 0) - L
    return torch.arange(int(L.sum())) - torch.repeat_interleave(starts, L)

