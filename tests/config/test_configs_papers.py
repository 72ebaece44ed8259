"""The method configs hold their papers' numbers; veRL / Search-R1 keys name their fastcredit key.

Each expected value below cites where it comes from: the paper's table or section, or
Search-R1's released scripts (scripts/nq_hotpotqa/v0.2/train_*.sh) and the veRL defaults in
its verl/trainer/config/ppo_trainer.yaml for what the scripts leave unset.
"""
import functools
import os
import re
import types

import pytest

from fastcredit.config import ConfigError, all_keys, load_config
from fastcredit.config.aliases import ALIASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "config-mapping.md")
SR1_GRPO = "Search-R1 v0.2/train_grpo.sh"
SR1_PPO = "Search-R1 v0.2/train_ppo.sh"
VERL = "Search-R1 verl/trainer/config/ppo_trainer.yaml"

# (config, key, expected, source). Search-R1's max_turns = k is k searches and an answer: k + 1 here.
EXPECTED = [
    ("searchr1_grpo", "rollout.max_turns", 5, f"{SR1_GRPO}: max_turns=4, plus the answer-only turn"),
    ("searchr1_grpo", "rollout.top_p", 0.95, f"{VERL}: rollout.top_p=0.95, not overridden"),
    ("searchr1_grpo", "loss.entropy_coef", 0.001, f"{VERL}: actor.entropy_coeff=0.001, not overridden"),
    ("searchr1_grpo", "loss.kl_coef", 0.001, f"{SR1_GRPO}: use_kl_loss=true, kl_loss_coef=0.001"),
    ("searchr1_grpo", "credit.kl_in_reward", 0.0, f"{SR1_GRPO}: use_kl_loss=true, no KL in the reward"),
    ("searchr1_grpo", "rollout.n_samples", 5, f"{SR1_GRPO}: n_agent=5"),
    ("searchr1_grpo", "optim.warmup_ratio", 0.285, f"{SR1_GRPO}: lr_warmup_steps_ratio=0.285"),
    ("searchr1_grpo", "optim.total_steps", 1005, f"{SR1_GRPO}: total_training_steps=1005"),
    ("searchr1_grpo", "optim.batch_prompts", 512, f"{SR1_GRPO}: train_batch_size=512"),
    ("searchr1_grpo", "optim.mini_batch_prompts", 64, f"{SR1_GRPO}: ppo_mini_batch_size=256 trajectories / 5"),
    ("searchr1_grpo", "data.max_prompt_tokens", 2048, f"{SR1_GRPO}: max_start_length=2048"),
    ("searchr1_grpo", "rollout.max_action_tokens", 500, f"{SR1_GRPO}: max_response_length=500"),
    ("searchr1_grpo", "rollout.max_obs_tokens", 500, f"{SR1_GRPO}: max_obs_length=500"),
    ("searchr1_grpo", "rollout.max_response_tokens", 4096, f"{SR1_GRPO}: max_prompt_length=4096"),
    ("searchr1_ppo", "rollout.max_turns", 5, f"{SR1_PPO}: max_turns=4, plus the answer-only turn"),
    ("searchr1_ppo", "rollout.top_p", 1.0, f"{SR1_PPO}: rollout.top_p=1.0"),
    ("searchr1_ppo", "loss.entropy_coef", 0.001, f"{VERL}: actor.entropy_coeff=0.001, not overridden"),
    ("searchr1_ppo", "loss.kl_coef", 0.0, f"{SR1_PPO}: use_kl_loss unset (False)"),
    ("searchr1_ppo", "credit.kl_in_reward", 0.001, f"{SR1_PPO}: algorithm.kl_ctrl.kl_coef=0.001, k1 in the reward"),
    ("searchr1_ppo", "credit.whiten_advantages", True, "Search-R1 core_algos.compute_gae_advantage_return"),
    ("searchr1_ppo", "credit.gamma", 1.0, f"{VERL}: algorithm.gamma=1.0"),
    ("searchr1_ppo", "credit.lam", 1.0, f"{VERL}: algorithm.lam=1.0"),
    ("searchr1_ppo", "optim.warmup_ratio", 0.285, f"{SR1_PPO}: actor lr_warmup_steps_ratio=0.285"),
    ("searchr1_ppo", "optim.critic_warmup_ratio", 0.015, f"{SR1_PPO}: critic lr_warmup_steps_ratio=0.015"),
    ("searchr1_ppo", "optim.critic_lr", 1e-5, f"{SR1_PPO}: critic.optim.lr=1e-5"),
    ("searchr1_ppo", "loss.value_clip", 0.5, f"{VERL}: critic.cliprange_value=0.5"),
    ("searchr1_ppo", "loss.vf_coef", 1.0, "Search-R1 core_algos.compute_value_loss: 0.5 * max(...), no weight"),
    ("searchr1_ppo", "rollout.n_samples", 1, f"{SR1_PPO}: n_agent=1"),
    ("searchr1_ppo", "optim.mini_batch_prompts", 256, f"{SR1_PPO}: ppo_mini_batch_size=256 at n_agent=1"),
    ("criticsearch", "data.train_path", "data/hotpotqa_train/train.parquet",
     "CriticSearch Section 4: trained on HotpotQA"),
    ("criticsearch", "rollout.max_turns", 5, "CriticSearch Appendix B: at most four turns of searching"),
    ("criticsearch", "rollout.max_response_tokens", 4096, "CriticSearch Appendix B: 4K context"),
    ("criticsearch", "optim.warmup_ratio", 0.35, "CriticSearch Appendix B: warm-up ratio 0.35"),
    ("criticsearch", "optim.total_steps", 800, "CriticSearch Appendix B: 800 steps"),
    ("criticsearch", "optim.batch_prompts", 128, "CriticSearch Appendix B: batch 128"),
    ("criticsearch", "optim.mini_batch_prompts", 16, "CriticSearch Appendix B: mini batch 64 trajectories / G = 5"),
    ("criticsearch", "rollout.n_samples", 5, "CriticSearch Appendix B: G = 5"),
    ("criticsearch", "loss.entropy_coef", 1e-3, "CriticSearch Appendix B: entropy 1e-3"),
    ("criticsearch", "loss.kl_coef", 1e-3, "CriticSearch Appendix B: KL loss 1e-3"),
    ("cwgrpo", "optim.warmup_ratio", 0.285, "CW-GRPO Table 2: warm-up ratio 0.285"),
    ("cwgrpo", "optim.total_steps", 200, "CW-GRPO Table 2: 200 training steps"),
    ("cwgrpo", "optim.batch_prompts", 32, "CW-GRPO Table 2: batch size 32"),
    ("cwgrpo", "rollout.n_samples", 4, "CW-GRPO Table 2: group size 4"),
    ("cwgrpo", "rollout.max_turns", 10, "CW-GRPO Section 4.3: up to 10 interaction rounds"),
    ("cwgrpo", "rollout.top_p", 1.0, "CW-GRPO Section 4.3: temperature and top_p 1.0"),
    ("cwgrpo", "optim.mini_batch_prompts", 8, "CW-GRPO released script: ppo_mini_batch_size=8 (x rollout.n)"),
    ("proceed", "rollout.max_turns", 10, "ProCeedRL Table 7: max steps 10 (per trajectory)"),
    ("proceed", "rollout.max_action_tokens", 4096, "ProCeedRL Table 6: max length per step 4096"),
    ("proceed", "rollout.top_p", 1.0, "ProCeedRL Table 6: top p 1.00"),
    ("proceed", "judges.backend", "http", "ProCeedRL Section 4.1: DeepSeek-V3-0528 critic (external)"),
    ("proceed", "judges.model", "deepseek-v3-0528", "ProCeedRL Section 4.1: DeepSeek-V3-0528 critic"),
    ("proceed", "data.train_path", "data/hotpotqa_curated_4k/train.parquet",
     "ProCeedRL Section 4.1: curated 4k HotpotQA"),
    ("proceed", "rollout.n_samples", 8, "ProCeedRL Table 6: group size 8"),
    ("proceed", "optim.batch_prompts", 16, "ProCeedRL Table 6: train batch size 16"),
    ("proceed", "loss.kl_coef", 0.01, "ProCeedRL Table 6: KL penalty 0.01"),
    ("proceed", "rollout.proceed.tau", 3, "ProCeedRL Table 7: threshold 3"),
    ("pica", "model.policy", "models/Qwen2.5-3B-Instruct", "PiCA Section 5.1: Qwen-2.5-3B-Instruct"),
    ("pica", "model.chat_template", True, "PiCA Section 5.1: an instruct policy"),
    ("pica", "rollout.n_samples", 5, "PiCA Table 5: rollout.n_agent 5"),
    ("pica", "optim.mini_batch_prompts", 8, "PiCA Table 5: ppo_mini_batch_size 32 trajectories / 5"),
    ("pica", "rollout.max_action_tokens", 800, "PiCA Table 5: data.max_response_length 800"),
    ("pica", "rollout.max_obs_tokens", 800, "PiCA Table 5: data.max_obs_length 800"),
    ("pica", "rollout.max_response_tokens", 8192, "PiCA Table 5: data.max_prompt_length 8192"),
    ("pica", "data.max_prompt_tokens", 2048, "PiCA Table 5: data.max_start_length 2048"),
    ("pica", "rollout.max_turns", 6, "PiCA Table 5: max_turns 5, plus the answer-only turn"),
    ("pica", "optim.warmup_ratio", 0.285, "PiCA Table 5: actor lr_warmup_steps_ratio 0.285"),
    ("pica", "optim.critic_warmup_ratio", 0.015, "PiCA Table 5: critic lr_warmup_steps_ratio 0.015"),
    ("pica", "optim.total_steps", 190, "PiCA Table 5: total_training_steps 190"),
    ("pica", "optim.batch_prompts", 256, "PiCA Table 5: train_batch_size 256"),
    ("pica", "credit.kl_in_reward", 0.001, "PiCA Table 5: algorithm.kl_ctrl.kl_coef 0.001, no KL loss"),
    ("pica", "loss.kl_coef", 0.0, "PiCA Table 5: no KL loss (use_kl_loss False)"),
    ("pica", "credit.whiten_advantages", True, "PiCA's Search-R1 core_algos: whitened GAE"),
    ("pica", "loss.value_clip", 0.5, "PiCA's ppo_trainer.yaml: critic.cliprange_value 0.5"),
    ("igsearch", "credit.estimator", "igsearch", "IG-Search: GRPO with information-gain step rewards"),
    ("igsearch", "model.policy", "models/Qwen2.5-3B", "IG-Search: Qwen2.5-3B"),
    ("igsearch", "rollout.n_samples", 5, "IG-Search: 5 samples a group"),
    ("igsearch", "rollout.max_turns", 6, "IG-Search: at most 5 searches, plus the answer-only turn"),
    ("igsearch", "retrieval.topk", 3, "IG-Search: top-3 documents"),
    ("igsearch", "credit.reward", "em", "IG-Search: EM outcome reward"),
    ("igsearch", "credit.igsearch.n_random", 3, "IG-Search ig_reward.py: n_random_per_step=3"),
]


@functools.lru_cache(maxsize=None)
def _config(name):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name, key, expected, source", EXPECTED,
                         ids=[f"{n}-{k}" for n, k, _, _ in EXPECTED])
def test_method_configs_hold_the_papers_values(name, key, expected, source):
    got = _get(_config(name), key)
    assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected, \
        f"configs/{name}.yaml {key} = {got!r}, {source} says {expected!r}"


def test_cwgrpo_context_is_9192_tokens():
    cw = _config("cwgrpo")  # CW-GRPO Section 4.3: maximum context length 9192
    assert cw.data.max_prompt_tokens + cw.rollout.max_response_tokens == 9192


def test_proceed_total_steps_is_not_the_per_trajectory_step_budget():
    pr = _config("proceed")  # Table 7's "max steps 10" is rollout.max_turns, not training steps
    assert pr.optim.total_steps != pr.rollout.max_turns and pr.optim.total_steps == 4000 // pr.optim.batch_prompts


@pytest.mark.parametrize("name", ["searchr1_grpo", "searchr1_ppo", "criticsearch", "cwgrpo", "proceed", "pica",
                                  "igsearch"])
def test_method_configs_read_real_data_and_the_overlays_the_toy_world(name):
    assert _config(name).data.source == "searchr1"
    for overlay in ("demo", "debug"):
        assert _config(overlay).data.source == "toy"


def test_every_alias_maps_to_a_real_key_and_is_not_one():
    keys = set(all_keys())
    for alias, (target, note) in ALIASES.items():
        assert alias not in keys, f"{alias} is a fastcredit key, so it can never be reported as an alias"
        assert target is None or target in keys, f"{alias} -> {target}: no such fastcredit key"
        assert note.strip(), alias


def test_the_doc_lists_every_alias_as_the_data_does():
    rows = re.findall(r"^\| `([^`]+)` \| (?:`([^`]+)`|—) \|", open(DOC, encoding="utf-8").read(), re.MULTILINE)
    documented = {alias: target or None for alias, target in rows}
    assert documented == {alias: target for alias, (target, _) in ALIASES.items()}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_override_names_the_fastcredit_key(alias):
    target, _ = ALIASES[alias]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{alias}=1"])
    message = str(err.value)
    assert f"unknown key '{alias}' (veRL/Search-R1's key)" in message
    assert (f"in fastcredit it is '{target}'" if target else "fastcredit has no equivalent") in message


def test_alias_errors_in_yaml(tmp_path):
    p = tmp_path / "verl.yaml"
    p.write_text("data:\n  train_batch_size: 512\n")
    with pytest.raises(ConfigError, match=r"verl.yaml line 2: unknown key 'data.train_batch_size' \(veRL/Search-R1's "
                                          r"key\): in fastcredit it is 'optim.batch_prompts'"):
        load_config(str(p))
    p.write_text("critic:\n  optim:\n    lr: 1.0e-5\n")  # a whole veRL section: its first key is named
    with pytest.raises(ConfigError, match=r"line 1: unknown key 'critic.optim.lr' \(veRL/Search-R1's key\): in "
                                          r"fastcredit it is 'optim.critic_lr'"):
        load_config(str(p))
    p.write_text("critic:\n  something_else: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'critic' \(a veRL/Search-R1 section; docs/config-mapping.md"):
        load_config(str(p))


def test_other_unknown_keys_still_get_a_guess():
    with pytest.raises(ConfigError, match="did you mean 'rollout.max_turns'"):
        load_config(None, ["rollout.max_turn=3"])


def test_the_value_model_warms_up_on_its_own_ratio():
    from fastcredit.trainer.schedule import LRSchedule, lr_factor

    lrs = {"policy": [], "value": []}
    policy, value = (types.SimpleNamespace(set_lr=lrs[k].append) for k in ("policy", "value"))
    path = os.path.join(ROOT, "configs", "searchr1_ppo.yaml")
    o = load_config(path, ["optim.total_steps=1000"]).optim  # 2000 optimizer steps: 2 mini-batches a step
    schedule = LRSchedule(o)
    for _ in range(100):
        schedule.before_step(policy, value)
    assert schedule.opt_steps == 100  # the critic warms up over 30 optimizer steps, the policy over 570
    assert lrs["value"][29] == pytest.approx(o.critic_lr) and lrs["value"][28] < o.critic_lr
    assert lrs["policy"][99] == pytest.approx(o.lr * lr_factor(99, 2000, 0.285, "constant"))
    assert lrs["policy"][99] < o.lr
    o = load_config(path, ["optim.total_steps=1000", "optim.critic_warmup_ratio=null"]).optim
    lrs["value"].clear()
    LRSchedule(o).before_step(policy, value)
    assert lrs["value"][0] == pytest.approx(o.critic_lr * lr_factor(0, 2000, 0.285, "constant"))


def test_a_critic_warmup_ratio_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"optim.critic_warmup_ratio must lie in \[0, 1\)"):
        load_config(None, ["optim.critic_warmup_ratio=1.0"])
