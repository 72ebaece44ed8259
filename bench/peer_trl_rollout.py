"""What TRL's ``GRPOTrainer`` rolls out with in the race (``bench/peer_trl.py``): two ``rollout_func`` callables.

    rollout = SearchR1Rollout(tokenizer, prompt_ids, Caps.from_config(cfg.rollout), client, topk=3)
    rollout = ReplayRollout(load_replay("work/replay"))      # fastcredit's recorded step batches, token for token

:class:`SearchR1Rollout` is the rollout a TRL user writes for Search-R1 with ``use_vllm=False``: every active
trajectory generates one turn in one ``model.generate`` call (transformers' own sampling and KV cache, stopping at
``</search>``, ``</answer>`` or EOS through ``stop_strings``), the turn's searches go to the ``/retrieve`` server in
one request, and the observation (Search-R1's ``<information>`` text, tokenized) is appended. ``env_mask`` is 1 on
the tokens the policy wrote and 0 on the observations, so TRL's loss never trains on them. The turn and token caps
are fastcredit's ``rollout.*`` keys with the agent loop's rules (``fastcredit.rollout.agent.Episode``), and a turn
is classified by fastcredit's own rule (``fastcredit.rollout.actions.classify_action``), so both trainers end the
same turns the same way.

:class:`ReplayRollout` returns, for TRL's step ``t``, the prompts, completions and masks fastcredit's rollout
produced at its step ``t`` (``bench/race_fastcredit.py`` records them), with the rewards fastcredit gave them; TRL
then trains on identical tokens. It refuses a batch whose prompts are not the recorded ones.

Each call leaves its figures in ``last_stats`` under the names fastcredit's step metrics use (``time/rollout``,
``decoded_tokens_per_traj``, ...), which ``bench/peer_trl.py``'s step clock logs beside the phases.
"""
from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from fastcredit.config.credit import outcome_reward
from fastcredit.credit.rewards import score_trajectory
from fastcredit.credit.types import TurnKind
from fastcredit.retrieval.observation import format_observation
from fastcredit.rollout.actions import INVALID_OBSERVATION, STOP_STRINGS, classify_action
from fastcredit.rollout.engines.base import GenOutput


@dataclass
class Caps:
    """A trajectory's budgets: fastcredit's ``rollout.max_turns``, ``max_action_tokens``, ``max_obs_tokens`` and
    ``max_response_tokens``."""

    max_turns: int
    max_action_tokens: int
    max_obs_tokens: int
    max_response_tokens: int

    @classmethod
    def from_config(cls, rollout_cfg) -> "Caps":
        r = rollout_cfg
        return cls(r.max_turns, r.max_action_tokens, r.max_obs_tokens, r.max_response_tokens)


class Trajectory:
    """One trajectory's turns: its context, the completion TRL trains on, the mask over it, its action texts."""

    def __init__(self, prompt_ids: list, caps: Caps):
        self.prompt_ids, self.caps = list(prompt_ids), caps
        self.completion: list = []  # actions and observations, back to back
        self.mask: list = []  # 1: written by the policy; 0: an observation
        self.kinds: list = []
        self.action_texts: list = []
        self.decoded = 0  # tokens generated for it, those past its own budget included
        self.done = False
        self._pending: Optional[list] = None  # a search's or an invalid turn's action, waiting for its observation

    @property
    def context(self) -> list:
        return self.prompt_ids + self.completion

    def budget(self) -> int:
        """Tokens its next action may take: the action cap, within what the response cap leaves (at least 1)."""
        return max(min(self.caps.max_action_tokens, self.caps.max_response_tokens - len(self.completion)), 1)

    def on_action(self, ids: list, text: str, stopped: bool):
        """Record an action (``stopped``: it ended at a stop string or EOS, else at its budget); returns its search
        query, ``""`` for an invalid turn (its observation is Search-R1's corrective message), or None when the
        trajectory ended."""
        kind, query = classify_action(text, GenOutput(ids, None, "stop" if stopped else "length"))
        out_of_length = len(self.completion) + len(ids) >= self.caps.max_response_tokens
        last_turn = len(self.kinds) + 1 >= self.caps.max_turns
        if kind != TurnKind.ANSWER and (out_of_length or last_turn):
            kind = TurnKind.TRUNCATED
        self.kinds.append(kind)
        self.action_texts.append(text)
        if kind in (TurnKind.ANSWER, TurnKind.TRUNCATED):
            self._append(ids, [])
            self.done = True
            return None
        self._pending = ids
        return query if kind == TurnKind.SEARCH else ""

    def on_observation(self, obs_ids: list) -> None:
        """Append the pending action and its observation (cut at ``max_obs_tokens``); an observation that would
        leave no room for another action token ends the trajectory on that action, truncated."""
        ids, self._pending = self._pending, None
        obs = list(obs_ids)[: self.caps.max_obs_tokens]
        if len(self.completion) + len(ids) + len(obs) + 1 > self.caps.max_response_tokens:
            self.kinds[-1] = TurnKind.TRUNCATED
            self._append(ids, [])
            self.done = True
            return
        self._append(ids, obs)

    def _append(self, action: list, obs: list) -> None:
        self.completion += list(action) + list(obs)
        self.mask += [1] * len(action) + [0] * len(obs)


def kept_tokens(new_ids: list, eos_ids: set, pad_id: Optional[int], decode) -> tuple[list, bool]:
    """``(ids, stopped)``: what one row of a ``generate`` call produced before it stopped: through the token that
    completed a stop string or through its first EOS, whichever came first (transformers fills a finished row with
    padding, which may be the EOS token itself), else all of it (it ran to the call's ``max_new_tokens``)."""
    end = next((i + 1 for i, t in enumerate(new_ids) if t in eos_ids), None)
    head = list(new_ids[:end])
    if any(s in decode(head) for s in STOP_STRINGS):
        lo, hi = 1, len(head)  # the shortest prefix holding a stop string: a prefix holding one only grows
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(head[:mid]) for s in STOP_STRINGS):
                hi = mid
            else:
                lo = mid + 1
        return head[:lo], True
    if end is not None:
        return head, True
    while pad_id is not None and head and head[-1] == pad_id:
        head.pop()
    return head, False


class SearchR1Rollout:
    """TRL ``rollout_func``: Search-R1's lockstep turns with ``model.generate``, searches over ``/retrieve``.

    ``prompt_ids``: the token ids of each prompt text the dataset holds (the same ids fastcredit's rollout starts
    from); ``client``: a ``fastcredit.retrieval.client.RetrievalClient``. Sampling follows the trainer's
    ``temperature``, ``top_p`` and ``top_k``; ``greedy`` decodes without sampling."""

    def __init__(self, tokenizer, prompt_ids: dict, caps: Caps, client, topk: int, greedy: bool = False):
        self.tokenizer, self.prompt_ids, self.caps, self.client, self.topk = tokenizer, prompt_ids, caps, client, topk
        self.greedy = greedy
        self.invalid_ids = self._ids(INVALID_OBSERVATION)
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if eos is not None else set()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.last_stats: dict = {}
        self._steps = [0, 0, 0]  # generate's forwards, rows summed over them, prompt tokens prefilled (padding too)

    def _ids(self, text: str) -> list:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def __call__(self, prompts: list, trainer) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        trajs = [Trajectory(self.prompt_ids[p], self.caps) for p in prompts]
        t0, generating, retrieving, searches = time.perf_counter(), 0.0, 0.0, 0
        self._steps = [0, 0, 0]
        while True:
            active = [t for t in trajs if not t.done]
            if not active:
                break
            g0 = time.perf_counter()
            outs = self.generate(model, trainer.args, [t.context for t in active], [t.budget() for t in active])
            generating += time.perf_counter() - g0
            queries = []
            for t, (ids, stopped, decoded) in zip(active, outs):
                t.decoded += decoded
                queries.append((t, t.on_action(ids, self._decode(ids), stopped)))
            searching = [(t, q) for t, q in queries if q]
            if searching:
                r0 = time.perf_counter()
                results = self.client.retrieve([q for _, q in searching], self.topk)
                retrieving += time.perf_counter() - r0
                searches += len(searching)
                for (t, _), docs in zip(searching, results):
                    t.on_observation(self._ids(format_observation(d.get("document", d)["contents"] for d in docs)))
            for t, q in queries:
                if q == "":
                    t.on_observation(self.invalid_ids)
        self.last_stats = rollout_stats(trajs, time.perf_counter() - t0, generating, retrieving)
        forwards, rows, prefilled = self._steps
        decoded = sum(t.decoded for t in trajs)
        # a sequence in flight decodes a token a forward; generate keeps finished rows in the batch (rows_per_step)
        self.last_stats.update({"engine/steps": float(forwards), "engine/seqs_per_step": decoded / max(forwards, 1),
                                "engine/rows_per_step": rows / max(forwards, 1),
                                "engine/prompt_tokens": float(prefilled), "engine/prefix_hit_rate": 0.0,
                                "engine/decoded_tokens": float(decoded),
                                "engine/prefill_per_decoded": prefilled / max(decoded, 1)})
        return {"prompt_ids": [t.prompt_ids for t in trajs], "completion_ids": [t.completion for t in trajs],
                "logprobs": None, "env_mask": [t.mask for t in trajs],
                "action_texts": [t.action_texts for t in trajs]}

    @torch.no_grad()
    def generate(self, model, args, contexts: list, budgets: list) -> list:
        """One ``generate`` call over ``contexts`` (left-padded): per row ``(kept ids, stopped, decoded)``, each row
        cut at its own budget (the call decodes up to the largest)."""
        from transformers import GenerationConfig

        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for r, c in enumerate(contexts):
            ids[r, width - len(c):] = torch.tensor(c)
            mask[r, width - len(c):] = 1
        sampled = not self.greedy and args.temperature > 0
        config = GenerationConfig(max_new_tokens=max(budgets), do_sample=sampled,
                                  temperature=args.temperature if sampled else None,
                                  top_p=args.top_p if sampled else None, top_k=args.top_k if sampled else None,
                                  eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad_id,
                                  stop_strings=list(STOP_STRINGS))
        device = next(model.parameters()).device
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             tokenizer=self.tokenizer)
        forwards = out.shape[1] - width  # a prefill, then a decode forward a token; finished rows stay in the batch
        self._steps = [self._steps[0] + forwards, self._steps[1] + forwards * len(contexts),
                       self._steps[2] + ids.numel()]
        rows = []
        for r, budget in enumerate(budgets):
            kept, stopped = kept_tokens(out[r, width:].tolist(), self.eos_ids, self.pad_id, self._decode)
            decoded = len(kept)
            if len(kept) > budget:
                kept, stopped = kept[:budget], False
            rows.append((kept, stopped, decoded))
        return rows


def rollout_stats(trajs: list, seconds: float, generating: float, retrieving: float) -> dict:
    """One rollout's figures under fastcredit's step-metric names (``fastcredit.rollout.agent``'s; ``tokens/trained``:
    the prompt and completion tokens every pass runs over, as ``fastcredit.trainer.step`` counts them)."""
    B = max(len(trajs), 1)
    kinds = [k for t in trajs for k in t.kinds]
    return {"time/rollout": seconds, "time/rollout/generating": generating, "time/rollout/retrieving": retrieving,
            "trajectories": len(trajs), "turns_per_traj": len(kinds) / B,
            "searches_per_traj": kinds.count(TurnKind.SEARCH) / B,
            "invalid_per_traj": kinds.count(TurnKind.INVALID) / B,
            "truncated_frac": kinds.count(TurnKind.TRUNCATED) / B,
            "response_tokens_mean": sum(len(t.completion) for t in trajs) / B,
            "decoded_tokens_per_traj": sum(t.decoded for t in trajs) / B,
            "tokens/trained": float(sum(len(t.prompt_ids) + len(t.completion) for t in trajs))}


def trl_reward(cfg):
    """A TRL reward function scoring each trajectory's answer as fastcredit's run of ``cfg`` does: its outcome reward
    (``credit.reward``, ``auto`` resolved) with its ``lambda_f`` and ``format_bonus``; the actions' texts come from the
    rollout, the gold answers from the dataset."""
    kind, c = outcome_reward(cfg), cfg.credit

    def reward(completions, action_texts, golden_answers, **kwargs) -> list:
        return [score_trajectory(a, g, kind=kind, lambda_f=c.lambda_f, format_bonus=c.format_bonus).reward
                for a, g in zip(action_texts, golden_answers)]

    reward.__name__ = f"{kind}_reward"  # TRL logs each reward function under its name
    return reward


def replayed_reward(completions, replay_reward, **kwargs) -> list:
    """TRL reward function of the replay: the reward fastcredit gave each recorded trajectory."""
    return list(replay_reward)


def load_replay(folder: str) -> list:
    """fastcredit's recorded step batches in ``folder`` (``step_<n>.json``, ``bench/race_fastcredit.py``), by step."""
    paths = sorted(glob.glob(os.path.join(folder, "step_*.json")))
    if not paths:
        raise FileNotFoundError(f"{folder}: no recorded step batches (step_*.json)")
    steps = []
    for path in paths:
        with open(path) as f:
            steps.append(json.load(f))
    if [s["step"] for s in steps] != list(range(len(steps))):
        raise ValueError(f"{folder}: the recorded steps are {[s['step'] for s in steps]}, not 0..{len(steps) - 1}")
    return steps


def group_prompts(step: dict) -> list:
    """The recorded step's prompts, one per group, in the batch's order (trajectories of a group are adjacent)."""
    out, last = [], None
    for g, p in zip(step["group_id"], step["prompt_ids"]):
        if g != last:
            out.append(p)
            last = g
    return out


class ReplayRollout:
    """TRL ``rollout_func`` that returns fastcredit's recorded batch of the trainer's current step (``steps``:
    :func:`load_replay`'s; a step is ``per_rollout`` of TRL's optimizer steps); ``decode`` turns prompt ids into
    the dataset's prompt text, which must match."""

    def __init__(self, steps: list, decode, per_rollout: int = 1):
        self.steps, self.decode, self.per_rollout = steps, decode, per_rollout
        self.last_stats: dict = {}

    def __call__(self, prompts: list, trainer) -> dict:
        t0 = time.perf_counter()
        n = trainer.state.global_step // self.per_rollout
        if n >= len(self.steps):
            raise IndexError(f"TRL asks for step {n}; only {len(self.steps)} steps were recorded")
        step = self.steps[n]
        want = [self.decode(p) for p in step["prompt_ids"]]
        if list(prompts) != want:
            bad = next(i for i, (a, b) in enumerate(zip(prompts, want)) if a != b) if len(prompts) == len(want) \
                else f"{len(prompts)} prompts for {len(want)} recorded"
            raise ValueError(f"step {n}: TRL's prompts are not the recorded ones (first difference: {bad})")
        B = len(step["tokens"])
        self.last_stats = {"time/rollout": time.perf_counter() - t0, "trajectories": B,
                           "response_tokens_mean": sum(len(t) for t in step["tokens"]) / max(B, 1),
                           "tokens/trained": float(sum(len(p) + len(t) for p, t in zip(step["prompt_ids"],
                                                                                      step["tokens"])))}
        return {"prompt_ids": step["prompt_ids"], "completion_ids": step["tokens"], "logprobs": None,
                "env_mask": step["action_mask"], "replay_reward": step["reward"]}
