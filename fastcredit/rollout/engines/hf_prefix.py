"""Prefix caching for the HF engine: a turn's context is the last turn's plus the action and its observation, so the
KV of what the engine already ran is kept and only the new tokens are prefilled (vLLM's ``enable_prefix_caching``,
per trajectory).

Legend: R rows, H key/value heads, D head size, C the longest cached prefix of the batch, S the longest new suffix.

When a row finishes, :meth:`PrefixCache.put` keeps its keys and values at its valid positions (the prompt and every
token fed back; the last sampled token never went through the model) under those token ids. A later prompt that
starts with a kept entry, and is longer, takes it (:meth:`PrefixCache.take`: each entry serves once, as each turn
extends its own trajectory) and :func:`join` lays the batch out as a prefill without a cache would (every row
right-aligned, no wider than the longest prompt), running only the S newest tokens of each row, each new token's
position counted from its own row's start. Entries are dropped when the weights change (their KV came from the
old ones), at the end of a rollout, and oldest first past ``budget_bytes``.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch


class PrefixCache:
    """Kept KV by token-id prefix; see the module docstring."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict = collections.OrderedDict()  # (n, hash) -> (ids, [(k, v) per layer])
        self._lengths: collections.Counter = collections.Counter()  # n -> entries of that length
        self.bytes, self.hits, self.reused_tokens = 0, 0, 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(kv: list) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def put(self, ids: Sequence[int], kv: list) -> None:
        """Keep ``kv`` (per layer ``(k [H, n, D], v [H, n, D])``) for the token ids ``ids`` (n of them)."""
        ids = tuple(ids)
        if not ids:
            return
        key = (len(ids), hash(ids))
        if key in self._entries:
            self._drop(key)
        size = self._size(kv)
        if size > self.budget_bytes:
            return
        while self._entries and self.bytes + size > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (ids, kv)
        self._lengths[len(ids)] += 1
        self.bytes += size

    def take(self, prompt: Sequence[int]) -> tuple[int, Optional[list]]:
        """``(n, kv)`` of the longest kept prefix of ``prompt`` shorter than it (at least one token is left to run),
        removed from the cache; ``(0, None)`` when none is kept."""
        for n in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            head = tuple(prompt[:n])
            entry = self._entries.get((n, hash(head)))
            if entry is not None and entry[0] == head:
                self._drop((n, hash(head)))
                self.hits += 1
                self.reused_tokens += n
                return n, entry[1]
        return 0, None

    def _drop(self, key) -> None:
        ids, kv = self._entries.pop(key)
        self._lengths[len(ids)] -= 1
        if not self._lengths[len(ids)]:
            del self._lengths[len(ids)]
        self.bytes -= self._size(kv)

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0


def row_kv(cache, row: int, valid: torch.Tensor) -> list:
    """Row ``row``'s keys and values at its ``valid`` positions ([T] bool), per layer, as its own tensors."""
    return [(layer.keys[row][:, valid].clone(), layer.values[row][:, valid].clone()) for layer in cache.layers]


def join(prompts: Sequence[Sequence[int]], hits: list, pad_id: int, config, device) -> tuple:
    """``(new ids [R, S], attention mask [R, C + S], position ids [R, S], cache)`` for rows of which ``hits[r]`` =
    ``(n, kv)`` holds the first n tokens' KV (``(0, None)``: nothing cached).

    S is the longest part any row must run; a row whose own new part is shorter runs the last tokens of its cached
    part again, so every row's tokens end right-aligned and contiguous, as in a prefill without a cache: the batch
    is no wider than its longest prompt (``C + S = max len``) and has no holes, which keeps each decode step's
    attention as short as before."""
    from transformers import DynamicCache

    R = len(prompts)
    S = max(len(p) - n for p, (n, _) in zip(prompts, hits))
    used = [max(0, min(n, len(p) - S)) for p, (n, _) in zip(prompts, hits)]  # cached tokens each row keeps
    C = max(used)
    ids_RS = torch.full((R, S), pad_id, dtype=torch.long)
    mask = torch.zeros((R, C + S), dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, used)):
        new = p[c:]
        ids_RS[r, S - len(new):] = torch.as_tensor(list(new))
        mask[r, C - c:C] = 1
        mask[r, C + S - len(new):] = 1
    pos_RS = (mask.cumsum(1) - 1).clamp(min=0)[:, C:]
    some = next(kv for _, kv in hits if kv is not None)
    cache = DynamicCache(config=config)
    for layer, (k0, v0) in enumerate(some):
        k = torch.zeros((R, k0.shape[0], C, k0.shape[-1]), dtype=k0.dtype, device=k0.device)
        v = torch.zeros((R, v0.shape[0], C, v0.shape[-1]), dtype=v0.dtype, device=v0.device)
        for r, ((_, kv), c) in enumerate(zip(hits, used)):
            if c:
                k[r, :, C - c:] = kv[layer][0][:, :c]
                v[r, :, C - c:] = kv[layer][1][:, :c]
        cache.update(k, v, layer)
    return ids_RS.to(device), mask.to(device), pos_RS.to(device), cache
