"""ProCeedRL rewind-and-refine rollouts (docs/methods.md §5).

In each group the first ``ceil(G · rollout.proceed.fraction)`` trajectories (paper: G/2)
are ProCeed rollouts. After each of their steps (an action and its observation; a final
answer without one) the process critic scores the step 0-10 with a critique. Below
``tau`` the step is rewound: the refiner writes a refined action from the history, the
rejected action and the critique; the environment executes it; the refined step replaces
the rejected one and the rollout goes on. The refined action's tokens get ``demo = 1``.
At most ``max_rewinds`` rewinds per trajectory; a refined step is not critiqued again.

The critic is the policy itself by default (``judges.backend`` decides otherwise) and the
refiner is the policy (``rollout.proceed.refiner = self``) or the judge engine
(``external``). Either way the refined action's tokens are stored in the trajectory's
ordinary context, so the trainer recomputes their old log-probs there (docs/methods.md §5).
"""
from __future__ import annotations

import asyncio
import math
from typing import Callable, Optional, Sequence

from fastcredit.runtime.devices import on_device
from fastcredit.rollout.agent import AgentLoop, Episode
from fastcredit.rollout.engines.base import GenOutput, SamplingParams


def proceed_flags(group_id: Sequence[int], fraction: float) -> list[bool]:
    """bool per trajectory: the first ``ceil(G · fraction)`` members of each group roll out with ProCeed."""
    sizes: dict = {}
    for g in group_id:
        sizes[g] = sizes.get(g, 0) + 1
    seen: dict = {}
    flags = []
    for g in group_id:
        flags.append(seen.get(g, 0) < math.ceil(sizes[g] * fraction))
        seen[g] = seen.get(g, 0) + 1
    return flags


def history_text(e: Episode, upto: int) -> str:
    """The trajectory's text before step ``upto`` (actions and observations, as the policy saw them)."""
    return "".join(s.action_text + s.obs_text for s in e.steps[:upto])


class ProceedHook:
    """The :class:`AgentLoop` step hook that critiques, rewinds and refines ProCeed trajectories.

    ``critic``: object with ``async ascore_step(question, history, action, observation, item,
    turn) -> (score or None, critique)`` (``fastcredit.judges.runner.ProcessCritic``);
    ``refine_prompt(question, history, rejected, critique) -> str``; ``refiner``: the engine
    that writes refined actions (the policy's for ``self``), called on the tokenized refiner
    prompt with the action's sampling parameters and stop strings; ``describe(episode)``:
    what the critic's ``item`` is made of (``fastcredit.judges.types.item_from_episode``;
    None passes no item).
    """

    def __init__(self, critic, refine_prompt: Callable[..., str], refiner, tokenizer, tau: int = 3,
                 max_rewinds: int = 4, self_refine: bool = True, describe: Optional[Callable] = None):
        self.critic, self.refine_prompt, self.refiner, self.tokenizer = critic, refine_prompt, refiner, tokenizer
        self.tau, self.max_rewinds, self.self_refine, self.describe = tau, max_rewinds, self_refine, describe
        self.stats = {"critiqued_steps": 0, "rewinds": 0, "critic_failures": 0}

    def take_stats(self) -> dict:
        """The counts since the last call (critiqued steps, rewinds, critic failures), then zeroed."""
        out, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        return out

    async def __call__(self, loop: AgentLoop, e: Episode, search) -> None:
        if not e.meta.get("proceed") or e.meta.get("rewinds", 0) >= self.max_rewinds or not e.steps:
            return
        step = e.steps[-1]
        if step.refined_from is not None:
            return
        question = e.meta.get("question", "")
        history = history_text(e, len(e.steps) - 1)
        item = self.describe(e) if self.describe is not None else None
        score, critique = await self.critic.ascore_step(question, history, step.action_text, step.obs_text,
                                                        item=item, turn=len(e.steps) - 1)
        self.stats["critiqued_steps"] += 1
        if score is None:
            self.stats["critic_failures"] += 1
            return
        step.critic_score = score
        if score >= self.tau:
            return
        e.meta["rewinds"] = e.meta.get("rewinds", 0) + 1
        self.stats["rewinds"] += 1
        prompt = self.refine_prompt(question, history, step.action_text, critique)
        params: SamplingParams = e.next_request()
        # The refined step replaces the rejected one: its budget is the rejected step's plus what was left.
        params.max_tokens = min(e.limits.max_action_tokens,
                                e.limits.max_response_tokens - e.response_len
                                + len(e.turns[-1].action_ids) + len(e.turns[-1].obs_ids))
        out = await self._refine(prompt, params)
        query = e.replace_last_step(out, refined_from=step.action_text)
        if query is not None:
            await loop.observe(e, query, search)

    async def _refine(self, prompt: str, params: SamplingParams) -> GenOutput:
        """The refined action: the policy engine's sampled ids, or an external model's text cut at
        the first stop string and tokenized with the policy's tokenizer."""
        if self.self_refine:
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            return await self.refiner.agenerate(ids, params)
        generate = on_device(getattr(self.refiner, "device", None), self.refiner.generate_text)
        text = (await asyncio.to_thread(generate, [prompt], params.max_tokens, params.temperature))[0]
        cut = [(text.find(s) + len(s), s) for s in params.stop if s in text]
        end, stop = min(cut) if cut else (len(text), None)
        ids = list(self.tokenizer(text[:end], add_special_tokens=False)["input_ids"])[: params.max_tokens]
        return GenOutput(ids, None, "stop" if stop else "length", stop)
