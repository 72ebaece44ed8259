"""veRL / Search-R1 config keys and what they are in fastcredit (docs/config-mapping.md).

    ALIASES["data.train_batch_size"] == ("optim.batch_prompts", "prompts per step in both ...")

Keys come from Search-R1's ``train_ppo.sh`` / ``train_grpo.sh`` command lines, its
``verl/trainer/config/ppo_trainer.yaml``, and the few newer-veRL keys the papers' released
scripts use (CW-GRPO, PiCA). A fastcredit key of None means there is no equivalent; the
note says why or what to do instead. ``fastcredit.config`` names the fastcredit key when
one of these is given (a YAML key or a ``key=value`` override). No torch import here.
"""
from __future__ import annotations

from typing import Optional

_CTX = ("Search-R1 cuts the whole rolling context (prompt + actions + observations so far) to its last "
        "max_prompt_length tokens; fastcredit caps actions + observations here and drops prompts longer "
        "than data.max_prompt_tokens, so the context is at most the sum of the two")
_MINI = ("units differ: Search-R1 multiplies it by rollout.n, which it keeps at 1 (groups come from n_agent), "
         "so it counts trajectories; fastcredit counts prompts, each with rollout.n_samples trajectories: use "
         "ppo_mini_batch_size / n_agent, rounded to a divisor of optim.batch_prompts (upstream veRL with "
         "rollout.n = G counts prompts, as fastcredit does)")
_MICRO = ("veRL counts sequences per micro-batch; fastcredit packs micro-batches by token count per rank; "
          "memory only, the update is the same")
_OFFLOAD = ("veRL moves them to the host between phases; fastcredit moves the whole training state with one switch: "
            "true / false as veRL's flags, default auto (kept on the GPU when the memory plan fits it there, moved "
            "otherwise; gradients are freed after each update). veRL's fsdp_config.offload_policy, FSDP2's CPU "
            "offload while training, is distributed.cpu_offload")

ALIASES: dict[str, tuple[Optional[str], str]] = {
    # data
    "data.train_files": ("data.train_path", "the training parquet; set data.source=searchr1"),
    "data.val_files": ("data.test_path", "the evaluation parquet"),
    "data.train_data_num": (None, "give a smaller training file instead"),
    "data.val_data_num": ("eval.questions", "held-out questions scored (0: no evaluation)"),
    "data.train_batch_size": ("optim.batch_prompts", "prompts per step in both; each prompt is "
                                                     "sampled rollout.n_samples times"),
    "data.val_batch_size": (None, "the rollout engine batches evaluation prompts itself"),
    "data.max_prompt_length": ("rollout.max_response_tokens", _CTX),
    "data.max_response_length": ("rollout.max_action_tokens", "tokens one generation call (one action) may produce"),
    "data.max_obs_length": ("rollout.max_obs_tokens", "cap on one observation's tokens"),
    "data.max_start_length": ("data.max_prompt_tokens", "Search-R1 keeps the last max_start_length prompt tokens; "
                                                        "fastcredit drops a longer prompt with a warning"),
    "data.shuffle_train_dataloader": ("data.shuffle", "reshuffle the training set every pass"),
    # the policy
    "actor_rollout_ref.model.path": ("model.policy", "a local folder; the reference policy "
                                                     "starts from the same weights"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        "distributed.activation_checkpointing", "recompute decoder layers in backward"),
    "actor_rollout_ref.model.use_remove_padding": (None, "fastcredit always packs sequences without padding"),
    "actor_rollout_ref.actor.optim.lr": ("optim.lr", "policy learning rate"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": (
        "optim.warmup_ratio", "veRL steps its scheduler once per training step, fastcredit once per optimizer step "
                              "over total_steps x updates per step: the same fraction of training"),
    "actor_rollout_ref.actor.optim.warmup_style": ("optim.schedule", "'constant' in both; 'cosine' also exists here"),
    "actor_rollout_ref.actor.optim.weight_decay": ("optim.weight_decay", "AdamW weight decay (0.01 in both)"),
    "actor_rollout_ref.actor.optim.betas": ("optim.betas", "AdamW betas"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("optim.mini_batch_prompts", _MINI),
    "actor_rollout_ref.actor.ppo_micro_batch_size": ("optim.micro_batch_tokens", _MICRO),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("optim.micro_batch_tokens", _MICRO),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (
        "optim.micro_batch_tokens", "tokens per rank and micro-batch, as veRL's dynamic batch size"),
    "actor_rollout_ref.actor.use_dynamic_bsz": (None, "always on: micro-batches are packed by "
                                                      "optim.micro_batch_tokens"),
    "actor_rollout_ref.actor.ppo_epochs": ("optim.ppo_epochs", "passes over each step's data"),
    "actor_rollout_ref.actor.shuffle": (None, "mini-batches keep whole groups in rollout order"),
    "actor_rollout_ref.actor.grad_clip": (
        "optim.grad_clip", "max global gradient norm (one value for policy and value model)"),
    "actor_rollout_ref.actor.clip_ratio": (
        "loss.clip_low", "veRL's symmetric clip: set loss.clip_low and loss.clip_high both"),
    "actor_rollout_ref.actor.clip_ratio_low": ("loss.clip_low", "ratio lower clip 1 - clip_low"),
    "actor_rollout_ref.actor.clip_ratio_high": ("loss.clip_high", "ratio upper clip 1 + clip_high"),
    "actor_rollout_ref.actor.clip_ratio_c": ("loss.dual_clip", "dual-clip constant for negative advantages"),
    "actor_rollout_ref.actor.entropy_coeff": ("loss.entropy_coef", "defaults differ: veRL 0.001, fastcredit 0"),
    "actor_rollout_ref.actor.use_kl_loss": (
        "loss.kl_coef", "true: KL in the loss, loss.kl_coef = kl_loss_coef; false: loss.kl_coef = 0 and the KL goes "
                        "into the reward, credit.kl_in_reward = algorithm.kl_ctrl.kl_coef"),
    "actor_rollout_ref.actor.kl_loss_coef": ("loss.kl_coef", "beta of the KL in the loss (when use_kl_loss=true)"),
    "actor_rollout_ref.actor.kl_loss_type": (None, "the loss KL is always k3, veRL's 'low_var_kl', "
                                                   "clamped to +-loss.kl_clamp"),
    "actor_rollout_ref.actor.loss_agg_mode": (
        "loss.agg_mode", "same names; Search-R1's fork averages tokens per micro-batch (close to token-mean)"),
    "actor_rollout_ref.actor.state_masking": (None, "always on: observation tokens never count in the loss"),
    "actor_rollout_ref.actor.fsdp_config.param_offload": ("distributed.offload_state", _OFFLOAD),
    "actor_rollout_ref.actor.fsdp_config.grad_offload": ("distributed.offload_state", _OFFLOAD),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": ("distributed.offload_state", _OFFLOAD),
    "actor_rollout_ref.actor.fsdp_config.offload_policy": (
        "distributed.cpu_offload", "FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state stay on the "
                                   "host while training too (the optimizer steps there)"),
    "actor_rollout_ref.ref.fsdp_config.param_offload": (
        "distributed.offload_state", "the frozen reference policy moves with the training state: onto the GPU for its "
                                     "pass, back to the host after it"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": ("optim.micro_batch_tokens", _MICRO),
    # the rollout
    "actor_rollout_ref.rollout.name": ("rollout.engine", "vllm or hf"),
    "actor_rollout_ref.rollout.n_agent": (
        "rollout.n_samples", "Search-R1's group size G (it repeats each prompt n_agent times)"),
    "actor_rollout_ref.rollout.n": (
        "rollout.n_samples", "upstream veRL's group size; Search-R1 keeps it at 1 and uses n_agent"),
    "actor_rollout_ref.rollout.temperature": ("rollout.temperature", "sampling temperature"),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", "defaults differ: veRL 0.95, fastcredit 1.0"),
    "actor_rollout_ref.rollout.top_k": ("rollout.top_k", "-1: off"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (
        "rollout.gpu_memory_utilization", "fastcredit's 0 sizes it from what is free"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout.tensor_parallel", "vLLM tensor parallel size"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": ("optim.micro_batch_tokens", _MICRO),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": (
        "rollout.max_turns", "counts every assistant turn, the answer included: the same unit"),
    "max_turns": ("rollout.max_turns", "Search-R1 runs max_turns search-capable turns, then one answer-only "
                                       "generation: its max_turns = k is rollout.max_turns = k + 1"),
    "do_search": (None, "always on; a model that never searches answers on its first turn"),
    "retriever.url": ("retrieval.url", "with retrieval.backend=http (a Search-R1 /retrieve server)"),
    "retriever.topk": ("retrieval.topk", "passages per search"),
    # the value model
    "critic.model.path": ("model.value", "null: the policy's weights with a fresh scalar head"),
    "critic.optim.lr": ("optim.critic_lr", "value-model learning rate"),
    "critic.optim.lr_warmup_steps_ratio": ("optim.critic_warmup_ratio", "null follows optim.warmup_ratio"),
    "critic.ppo_micro_batch_size": ("optim.micro_batch_tokens", _MICRO),
    "critic.cliprange_value": ("loss.value_clip", "defaults differ: veRL 0.5, fastcredit 0.2"),
    "critic.grad_clip": ("optim.grad_clip", "one value for policy and value model"),
    "critic.model.enable_gradient_checkpointing": (
        "distributed.activation_checkpointing", "one switch for both models"),
    "critic.model.fsdp_config.param_offload": ("distributed.offload_state", _OFFLOAD),
    "critic.model.fsdp_config.grad_offload": ("distributed.offload_state", _OFFLOAD),
    "critic.model.fsdp_config.optimizer_offload": ("distributed.offload_state", _OFFLOAD),
    # the algorithm
    "algorithm.adv_estimator": ("credit.estimator", "gae is ppo (or pica), grpo is grpo"),
    "algorithm.gamma": ("credit.gamma", "GAE discount (ppo, pica); verl-agent's GiGPO reads it as the step "
                                        "returns' discount: credit.gigpo.gamma"),
    "algorithm.lam": ("credit.lam", "GAE lambda"),
    "algorithm.kl_ctrl.kl_coef": (
        "credit.kl_in_reward", "beta of the per-token k1 KL in the reward; veRL applies it "
                               "only when use_kl_loss=false"),
    "algorithm.kl_ctrl.type": (None, "fixed only: no adaptive KL controller"),
    "algorithm.kl_penalty": (None, "the KL in the reward is always veRL's 'kl' (k1): logp_old - logp_ref"),
    "algorithm.use_kl_in_reward": ("credit.kl_in_reward", "newer veRL's switch: false is credit.kl_in_reward = 0"),
    "algorithm.norm_adv_by_std_in_grpo": ("credit.norm_by_std", "false: Dr. GRPO"),
    "algorithm.no_think_rl": (None, "not implemented"),
    # verl-agent's GiGPO (its run_search.sh)
    "algorithm.gigpo.step_advantage_w": ("credit.gigpo.omega", "weight of the step advantage: A = A_episode + "
                                                               "omega * A_step"),
    "algorithm.gigpo.mode": ("credit.gigpo.step_norm", "mean_std_norm or mean_norm; verl-agent's one switch sets "
                                                       "both levels: for the episode level set credit.norm_by_std "
                                                       "(mean_norm is false)"),
    "algorithm.gigpo.enable_similarity": ("credit.gigpo.match", "True is similar, False is exact"),
    "algorithm.gigpo.similarity_thresh": ("credit.gigpo.threshold", "least similarity of two anchor states in "
                                                                    "one step group"),
    "reward_model.structure_format_score": (
        "credit.lambda_f", "with credit.reward=criticsearch (1, 1 - lambda_f, lambda_f, 0: "
                           "Search-R1 v0.3's format reward)"),
    "reward_model.final_format_score": (None, "Search-R1 v0.3's score of a wrong, "
                                              "ill-formatted answer; not implemented"),
    "reward_model.retrieval_score": (None, "Search-R1 v0.3's bonus for retrieving the gold answer; not implemented"),
    # the trainer
    "trainer.total_training_steps": ("optim.total_steps", "training steps"),
    "trainer.total_epochs": (None, "fastcredit counts steps only (optim.total_steps) and reshuffles every pass"),
    "trainer.save_freq": ("logging.checkpoint_every", "steps between checkpoints"),
    "trainer.test_freq": ("eval.every", "steps between evaluations (it also runs before and after training)"),
    "trainer.val_before_train": (None, "always: an evaluation runs before training when eval.questions > 0"),
    "trainer.critic_warmup": (None, "policy and value model are updated from the first step (Search-R1 sets 0)"),
    "trainer.n_gpus_per_node": (None, "torchrun --nproc_per_node"),
    "trainer.nnodes": (None, "torchrun --nnodes"),
    "trainer.default_local_dir": ("logging.output_dir", "run directory: merged config, metrics, checkpoints"),
    "trainer.experiment_name": ("run_name", "name shown in logs"),
    "trainer.project_name": (None, "a W&B project comes from the environment (WANDB_PROJECT)"),
    "trainer.logger": ("logging.wandb", "logging.wandb / logging.tensorboard / logging.jsonl switch the sinks"),
}

SOURCE = "veRL/Search-R1"
ORIGIN = f"{SOURCE}'s key"


def describe_alias(key: str) -> str:
    """``"(veRL/Search-R1's key): in fastcredit it is 'x' — note"`` for an alias ``key``."""
    target, note = ALIASES[key]
    if target is None:
        return f"({ORIGIN}): fastcredit has no equivalent — {note}"
    return f"({ORIGIN}): in fastcredit it is '{target}' — {note}"


def explain_unknown(dotted: str, full: Optional[str] = None) -> Optional[str]:
    """The message for an unknown ``dotted`` key that is (or leads to) a veRL/Search-R1 key, else None.

    ``full``: the whole key being set when ``dotted`` is only its first unknown part (``critic``
    of ``critic.optim.lr=…``, or the first key under an unknown YAML section).
    """
    full = full or dotted
    for key in (full, dotted):
        if key in ALIASES and (key == dotted or key.startswith(dotted + ".")):
            return f"unknown key '{key}' {describe_alias(key)}"
    below = [k for k in ALIASES if k.startswith(dotted + ".")]
    if not below:
        return None
    examples = ", ".join(f"{k} -> {ALIASES[k][0] or 'none'}" for k in below[:2])
    return (f"unknown key '{dotted}' (a {SOURCE} section; docs/config-mapping.md maps its {len(below)} keys, "
            f"e.g. {examples})")
