"""The ``hf`` engine: a transformers causal LM with its own batched decode loop (any device; the reference).

Legend: R requests in the batch, L padded prompt length, V vocabulary.

Prompts are left-padded; one forward over the prompts fills the KV cache, then one token
per step for every unfinished row. Each row has its own sampling parameters, generator
(seeded per request when ``seed`` is set) and stop rules: a stop token, or a stop string
found in the row's decoded tail, ends the row right after the token that completed it.
A row with an output grammar (``SamplingParams.constraint``) samples only the tokens its
decoder allows and ends as soon as the grammar is complete (``fastcredit.judges.grammar``).
The loop ends when every row has finished or used its ``max_tokens``. Finished rows are
dropped from the batch (and from the KV cache) so long rows do not pay for short ones.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams

_TAIL_TOKENS = 16  # tokens decoded to look for a stop string (the longest tag is a few tokens)


def _sample(logits_RV: torch.Tensor, params: list[SamplingParams], gens: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob (temperature-scaled) for every row."""
    out, lps = [], []
    for r, (p, g) in enumerate(zip(params, gens)):
        z = logits_RV[r].float()
        if p.temperature <= 0:
            tok = int(torch.argmax(z))
            lps.append(float(torch.log_softmax(z, -1)[tok]))
            out.append(tok)
            continue
        z = z / p.temperature
        logp = torch.log_softmax(z, -1)
        masked = z.clone()
        if p.top_k > 0 and p.top_k < z.numel():
            kth = torch.topk(z, p.top_k).values[-1]
            masked[masked < kth] = -float("inf")
        if p.top_p < 1.0:
            sorted_z, order = torch.sort(masked, descending=True)
            cum = torch.cumsum(torch.softmax(sorted_z, -1), -1)
            drop = cum - torch.softmax(sorted_z, -1) > p.top_p  # keep the smallest prefix reaching top_p
            masked[order[drop]] = -float("inf")
        tok = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=g))
        out.append(tok)
        lps.append(float(logp[tok]))
    return torch.tensor(out), torch.tensor(lps)


class HFEngine(Engine):
    """Generation with a transformers model on ``device``; ``max_batch`` rows per forward."""

    def __init__(self, model, tokenizer, device: Union[str, torch.device] = "cpu", max_batch: int = 64,
                 batch_timeout_ms: float = 5.0):
        self.model = model.to(device).eval()
        self.tokenizer, self.device = tokenizer, torch.device(device)
        self.max_batch, self.batch_timeout_ms = max_batch, batch_timeout_ms
        self.weight_dtype = next(self.model.parameters()).dtype
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]]) -> list[GenOutput]:
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameters for {len(prompts)} prompts")
        outs: list = []
        for i in range(0, len(prompts), self.max_batch):
            outs += self._batch(prompts[i:i + self.max_batch], params[i:i + self.max_batch])
        return outs

    def _generators(self, params: list[SamplingParams]) -> list:
        gens = []
        for p in params:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))  # from the global RNG
            gens.append(torch.Generator(device=self.device).manual_seed(seed))  # multinomial: same device
        return gens

    @torch.inference_mode()
    def _batch(self, prompts: Sequence[Sequence[int]], params: list[SamplingParams]) -> list[GenOutput]:
        R = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        L = max(len(p) for p in prompts)
        ids = torch.full((R, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((R, L), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, L - len(p):] = torch.as_tensor(list(p))
            mask[r, L - len(p):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        gens = self._generators(params)
        toks: list[list[int]] = [[] for _ in range(R)]
        lps: list[list[float]] = [[] for _ in range(R)]
        done: list = [None] * R  # (finish_reason, stop_reason) once finished
        alive = list(range(R))
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        mask, last_pos = mask.to(self.device), pos[:, -1].to(self.device)
        procs = [None if p.constraint is None else p.constraint.decoder(
            p.constraint.tokenizer or self.tokenizer, p.max_tokens, logits.shape[-1], p.stop_token_ids) for p in params]
        while alive:
            for j, r in enumerate(alive):
                if procs[r] is not None:
                    procs[r].apply(logits[j])
            nxt, lp = _sample(logits, [params[r] for r in alive], [gens[r] for r in alive])
            keep = []
            for j, r in enumerate(alive):
                toks[r].append(int(nxt[j]))
                lps[r].append(float(lp[j]))
                if procs[r] is not None:
                    procs[r].advance(toks[r][-1])
                done[r] = ("stop", None) if procs[r] is not None and procs[r].done \
                    else self._finished(toks[r], params[r])
                if done[r] is None:
                    keep.append(j)
            if len(keep) < len(alive):  # drop finished rows from the batch and the cache
                if not keep:
                    break
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                nxt, mask, last_pos = nxt[keep], mask[sel], last_pos[sel]
                alive = [alive[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype, device=self.device)], 1)
            last_pos = last_pos + 1
            out = self.model(input_ids=nxt[:, None].to(self.device), attention_mask=mask,
                             position_ids=last_pos[:, None], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
        return [GenOutput(toks[r], lps[r] if params[r].logprobs else None, done[r][0], done[r][1],
                          version=self.weights_version) for r in range(R)]

    def _finished(self, toks: list[int], p: SamplingParams):
        if toks[-1] in p.stop_token_ids:
            return "stop", toks[-1]
        if p.stop:
            tail = self.tokenizer.decode(toks[-_TAIL_TOKENS:], skip_special_tokens=False)
            last = self.tokenizer.decode(toks[-1:], skip_special_tokens=False)
            for s in p.stop:
                # The stop string must end inside the newest token, else an earlier step would have stopped.
                at = tail.rfind(s)
                if at >= 0 and at + len(s) > len(tail) - len(last):
                    return "stop", s
        if len(toks) >= p.max_tokens:
            return "length", None
        return None

    def sleep(self, level: int = 1) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self, tags=None) -> None:
        if self.device.type == "cuda" and (tags is None or "weights" in tags):
            self.model.to(self.device)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.model.state_dict(keep_vars=True)
        for name, t in named_tensors:
            if name not in own:
                raise KeyError(f"update_weights: the engine's model has no tensor named {name!r}")
            own[name].data.copy_(t.to(own[name].device, own[name].dtype))


def make_engine(kind: str, model, tokenizer, rollout_cfg=None, device="cpu", model_path: Optional[str] = None,
                memory_utilization: Optional[float] = None, load_format: str = "auto") -> Engine:
    """An engine by name: ``hf`` (this module, generating with ``model``) or ``vllm``
    (fastcredit.rollout.engines.vllm: started on ``model_path``, else on ``model`` saved to a folder;
    ``memory_utilization`` overrides ``rollout.gpu_memory_utilization``; ``load_format`` ``dummy``: the
    folder's config only, weights streamed in later)."""
    if kind == "hf":
        return HFEngine(model, tokenizer, device)
    if kind == "vllm":
        from fastcredit.rollout.engines.vllm import VLLMEngine

        if model_path is not None:
            return VLLMEngine(model_path, tokenizer, rollout_cfg, device, memory_utilization=memory_utilization,
                              load_format=load_format)
        return VLLMEngine.from_module(model, tokenizer, rollout_cfg, device)
    raise ValueError(f"unknown rollout.engine {kind!r}; valid: hf, vllm")
