"""The ``hf`` engine: a transformers causal LM with its own batched decode loop (any device; the reference).

Legend: R requests in the batch, L padded prompt length, V vocabulary.

Prompts are left-padded; one forward over the prompts fills the KV cache, then one token
per step for every unfinished row. Each row has its own sampling parameters, generator
(seeded per request when ``seed`` is set) and stop rules: a stop token, or a stop string
found in the row's decoded tail, ends the row right after the token that completed it.
A row with an output grammar (``SamplingParams.constraint``) samples only the tokens its
decoder allows and ends as soon as the grammar is complete (``fastcredit.judges.grammar``).
The loop ends when every row has finished or used its ``max_tokens``. Finished rows are
dropped from the batch (and from the KV cache) so long rows do not pay for short ones. The
prefill computes the last position's logits only, and with prefix caching a prompt that extends
a finished row's tokens prefills only its new tokens (``hf_prefix``).
"""
from __future__ import annotations

import inspect
import time
from typing import Iterable, Optional, Sequence, Union

import torch

from fastcredit.rollout.engines.base import Engine, GenOutput, SamplingParams, StepCounters
from fastcredit.rollout.engines.hf_prefix import PrefixCache, join, row_kv

_TAIL_TOKENS = 16  # tokens decoded to look for a stop string (the longest tag is a few tokens)


def _sample(logits_RV: torch.Tensor, params: list[SamplingParams], gens: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob (temperature-scaled) for every row.

    The softmaxes run over the whole batch at once (a row's values are those of the row alone: the kernels work
    row by row). A sampled row draws one uniform number from its own generator and takes the token where the
    cumulative probability (float64) first exceeds it: an exact draw from the row's distribution, the same tokens
    for a seeded request in any batch, and one random number a token instead of the vocabulary's worth that
    ``torch.multinomial`` draws (its exponential race: most of the CPU decode's time at V = 6,000)."""
    temps = [p.temperature for p in params]
    sampled = [r for r, t in enumerate(temps) if t > 0]
    z_RV = logits_RV.float()
    if sampled:  # a greedy row keeps its logits (its temperature counts as 1)
        scale = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=logits_RV.device)
        z_RV = z_RV / scale[:, None]
    logp_RV = torch.log_softmax(z_RV, -1)
    every = len(sampled) == len(params)
    tok_R = None if every else torch.argmax(z_RV, -1)  # greedy rows' tokens (sampled rows' are replaced)
    if sampled:
        masked_SV = z_RV if every else z_RV[sampled]
        truncated = False
        for i, r in enumerate(sampled):
            p = params[r]
            if p.top_k > 0 and p.top_k < masked_SV.shape[1]:
                kth = torch.topk(masked_SV[i], p.top_k).values[-1]
                masked_SV[i, masked_SV[i] < kth] = -float("inf")
                truncated = True
            if p.top_p < 1.0:
                sorted_z, order = torch.sort(masked_SV[i], descending=True)
                probs = torch.softmax(sorted_z, -1)
                drop = torch.cumsum(probs, -1) - probs > p.top_p  # keep the smallest prefix reaching top_p
                masked_SV[i, order[drop]] = -float("inf")
                truncated = True
        if truncated:
            probs_SV = torch.softmax(masked_SV, -1)
        else:  # nothing masked: the probabilities are the log-softmax's, exponentiated
            probs_SV = (logp_RV if every else logp_RV[sampled]).exp()
        cdf_SV = torch.cumsum(probs_SV.double(), -1)
        u_S = torch.cat([torch.rand(1, generator=gens[r], dtype=torch.float64, device=gens[r].device)
                         for r in sampled]).to(cdf_SV.device)
        # the first index whose cumulative mass exceeds u x total (a zero-probability token never does)
        pick_S = torch.searchsorted(cdf_SV, (u_S * cdf_SV[:, -1])[:, None], right=True)[:, 0]
        pick_S = pick_S.clamp(max=cdf_SV.shape[1] - 1)
        if every:
            tok_R = pick_S
        else:
            tok_R[sampled] = pick_S
    lp_R = logp_RV.gather(1, tok_R[:, None])[:, 0]
    return tok_R.cpu(), lp_R.cpu()


class HFEngine(Engine):
    """Generation with a transformers model on ``device``; ``max_batch`` rows per forward."""

    def __init__(self, model, tokenizer, device: Union[str, torch.device] = "cpu", max_batch: int = 64,
                 batch_timeout_ms: float = 5.0, prefix_caching: bool = False, prefix_budget_gib: float = 1.0):
        """``prefix_caching``: keep each finished row's KV and prefill only what a later prompt adds to it
        (``rollout.enable_prefix_caching``; :mod:`fastcredit.rollout.engines.hf_prefix`), within
        ``prefix_budget_gib``."""
        self.model = model.to(device).eval()
        self.tokenizer, self.device = tokenizer, torch.device(device)
        self.max_batch, self.batch_timeout_ms = max_batch, batch_timeout_ms
        self.weight_dtype = next(self.model.parameters()).dtype
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._pieces: dict[int, str] = {}  # token id -> its text, for the stop-string check
        self.prefix = PrefixCache(int(prefix_budget_gib * 2**30)) if prefix_caching else None
        # The prefill needs the last position's logits only: transformers' causal LMs take logits_to_keep=1 and skip
        # the LM head over every other prompt position ([R, L, V] logits: most of a small model's prefill).
        self._last_only = ({"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters
                           else {})
        # every forward is a step: a batch's prefill (an "admitting" step) and each of its decode steps
        self.counters = StepCounters()

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
        gens = self._generators(params)
        toks: list[list[int]] = [[] for _ in range(R)]
        lps: list[list[float]] = [[] for _ in range(R)]
        done: list = [None] * R  # (finish_reason, stop_reason) once finished
        alive = list(range(R))
        t = time.perf_counter()
        out, mask, last_pos = self._prefill(prompts)
        self._count(R, time.perf_counter() - t, admitted=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        procs = [None if p.constraint is None else p.constraint.decoder(
            p.constraint.tokenizer or self.tokenizer, p.max_tokens, logits.shape[-1], p.stop_token_ids) for p in params]
        while alive:
            for j, r in enumerate(alive):
                if procs[r] is not None:
                    procs[r].apply(logits[j])
            nxt, lp = _sample(logits, [params[r] for r in alive], [gens[r] for r in alive])
            keep, nxt_list, lp_list = [], nxt.tolist(), lp.tolist()
            for j, r in enumerate(alive):
                toks[r].append(nxt_list[j])
                lps[r].append(lp_list[j])
                if procs[r] is not None:
                    procs[r].advance(toks[r][-1])
                done[r] = ("stop", None) if procs[r] is not None and procs[r].done \
                    else self._finished(toks[r], params[r])
                if done[r] is None:
                    keep.append(j)
                elif self.prefix is not None:  # its KV covers the prompt and every token fed back (not the last)
                    self.prefix.put(list(prompts[r]) + toks[r][:-1], row_kv(cache, j, mask[j].bool()))
            if len(keep) < len(alive):  # drop finished rows from the batch and the cache
                if not keep:
                    break
                sel = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(sel)
                nxt, mask, last_pos = nxt[keep], mask[sel], last_pos[sel]
                alive = [alive[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype, device=self.device)], 1)
            last_pos = last_pos + 1
            t = time.perf_counter()
            out = self.model(input_ids=nxt[:, None].to(self.device), attention_mask=mask,
                             position_ids=last_pos[:, None], past_key_values=cache, use_cache=True)
            self._count(len(alive), time.perf_counter() - t)
            cache, logits = out.past_key_values, out.logits[:, -1]
        c = self.counters
        c.requests += R
        c.prompt_tokens += sum(len(p) for p in prompts)
        c.decoded_tokens += sum(len(x) for x in toks)
        return [GenOutput(toks[r], lps[r] if params[r].logprobs else None, done[r][0], done[r][1],
                          version=self.weights_version) for r in range(R)]

    def _count(self, seqs: int, seconds: float, admitted: bool = False) -> None:
        c = self.counters
        c.steps, c.step_s, c.seqs = c.steps + 1, c.step_s + seconds, c.seqs + seqs
        if admitted:
            c.admit_steps, c.admit_s, c.admit_seqs = c.admit_steps + 1, c.admit_s + seconds, c.admit_seqs + seqs

    def take_step_counters(self) -> dict:
        """The forwards' counters since the last call (:class:`~fastcredit.rollout.engines.base.StepCounters`:
        prefills count as admitting steps; the prefix cache's hits are the prompt tokens it saved)."""
        taken, self.counters = self.counters, StepCounters()
        return taken.metrics()

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple:
        """The prompts' forward: ``(output, attention mask [R, T], last position [R])``. Rows whose prompt extends a
        kept prefix run only the tokens after it (:mod:`~fastcredit.rollout.engines.hf_prefix`)."""
        hits = [self.prefix.take(p) for p in prompts] if self.prefix is not None else []
        self.counters.cached_tokens += sum(n for n, kv in hits if kv is not None)
        if any(kv is not None for _, kv in hits):
            ids, mask, pos, past = join(prompts, hits, self.pad_id, self.model.config, self.device)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                             use_cache=True, **self._last_only)
            return out, mask, pos[:, -1]
        R, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((R, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((R, L), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, L - len(p):] = torch.as_tensor(list(p))
            mask[r, L - len(p):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=pos.to(self.device), use_cache=True, **self._last_only)
        return out, mask.to(self.device), pos[:, -1].to(self.device)

    def end_rollout(self) -> None:
        super().end_rollout()
        if self.prefix is not None:  # the next rollout's prompts are new
            self.prefix.clear()

    def _piece(self, tok: int) -> str:
        """One token's text, decoded once per engine."""
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self._pieces[tok] = self.tokenizer.decode([tok], skip_special_tokens=False)
        return piece

    def _finished(self, toks: list[int], p: SamplingParams):
        if toks[-1] in p.stop_token_ids:
            return "stop", toks[-1]
        # a stop string ends inside the newest token, so that token's text holds its last character: most tokens
        # hold none, and the tail is decoded only for the others
        if p.stop and any(s[-1:] in self._piece(toks[-1]) for s in p.stop):
            tail = self.tokenizer.decode(toks[-_TAIL_TOKENS:], skip_special_tokens=False)
            last = self._piece(toks[-1])
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
        if self.prefix is not None:  # its KV came from the old weights
            self.prefix.clear()
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
        return HFEngine(model, tokenizer, device,
                        prefix_caching=bool(getattr(rollout_cfg, "enable_prefix_caching", False)))
    if kind == "vllm":
        from fastcredit.rollout.engines.vllm import VLLMEngine

        if model_path is not None:
            return VLLMEngine(model_path, tokenizer, rollout_cfg, device, memory_utilization=memory_utilization,
                              load_format=load_format)
        return VLLMEngine.from_module(model, tokenizer, rollout_cfg, device)
    raise ValueError(f"unknown rollout.engine {kind!r}; valid: hf, vllm")
