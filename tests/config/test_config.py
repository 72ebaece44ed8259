"""The config tree: YAML files, dotted overrides, errors that name the key, round trips."""
import dataclasses
import glob
import math
import os
import subprocess
import sys
import typing

import pytest

from fastcredit.config.help import describe
from fastcredit.config import (
    ConfigError,
    TrainConfig,
    all_keys,
    load_config,
    save_config,
)
from fastcredit.trainer.build import train_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
METHODS = ["searchr1_grpo", "searchr1_ppo", "criticsearch", "cwgrpo", "proceed", "pica", "demo", "debug"]


def test_every_method_has_a_config():
    names = {os.path.basename(p)[:-5] for p in CONFIGS}
    assert set(METHODS) <= names


def _root(path):
    """The config class a file belongs to: the PRM trainer's for prm*.yaml, the RL trainer's otherwise."""
    if os.path.basename(path).startswith("prm"):
        from fastcredit.prm.config import PRMTrainConfig

        return PRMTrainConfig
    return TrainConfig


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p))
def test_every_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path, root=_root(path))
    out = tmp_path / "merged.yaml"
    save_config(cfg, str(out))
    assert load_config(str(out), root=_root(path)) == cfg


def test_method_configs_select_their_estimator():
    expected = {"searchr1_grpo": "grpo", "searchr1_ppo": "ppo", "criticsearch": "criticsearch",
                "cwgrpo": "cwgrpo", "proceed": "proceed", "pica": "pica"}
    for name, estimator in expected.items():
        assert load_config(os.path.join(ROOT, "configs", f"{name}.yaml")).credit.estimator == estimator


def test_paper_settings_spot_checks():
    cs = load_config(os.path.join(ROOT, "configs", "criticsearch.yaml"))
    assert (cs.rollout.n_samples, cs.optim.lr, cs.credit.criticsearch.alpha) == (5, 5e-7, 0.25)
    assert (cs.loss.kl_coef, cs.loss.entropy_coef, cs.optim.warmup_ratio) == (1e-3, 1e-3, 0.35)
    cw = load_config(os.path.join(ROOT, "configs", "cwgrpo.yaml"))
    assert math.isinf(cw.credit.cwgrpo.alpha) and cw.rollout.n_samples == 4 and cw.rollout.max_turns == 10
    pr = load_config(os.path.join(ROOT, "configs", "proceed.yaml"))
    assert (pr.loss.clip_low, pr.loss.clip_high, pr.rollout.proceed.tau, pr.rollout.n_samples) == (0.2, 0.28, 3, 8)
    pica = load_config(os.path.join(ROOT, "configs", "pica.yaml"))
    assert (pica.credit.pica.s_step, pica.credit.pica.s_out, pica.optim.critic_lr) == (0.3, 1.5, 7e-6)


def test_overrides_apply_after_yaml():
    path = os.path.join(ROOT, "configs", "criticsearch.yaml")
    cfg = load_config(path, ["credit.criticsearch.alpha=0.5", "rollout.max_turns=6", "optim.lr=1e-6"])
    assert (cfg.credit.criticsearch.alpha, cfg.rollout.max_turns, cfg.optim.lr) == (0.5, 6, 1e-6)


@pytest.mark.parametrize("raw", ["inf", ".inf", "Infinity", "∞"])
def test_infinity_is_accepted_for_floats(raw):
    cfg = load_config(None, ["judges.backend=oracle", "credit.estimator=cwgrpo", f"credit.cwgrpo.alpha={raw}"])
    assert math.isinf(cfg.credit.cwgrpo.alpha)


def test_string_fields_keep_cli_text_verbatim():
    cfg = load_config(None, ["model.policy=007", "retrieval.query_prefix=query: "])
    assert cfg.model.policy == "007" and cfg.retrieval.query_prefix == "query: "


def test_optional_fields_take_null():
    cfg = load_config(None, ["model.tokenizer=tok", "model.tokenizer=null"])
    assert cfg.model.tokenizer is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("credit.estmator=grpo", "unknown key 'credit.estmator'; did you mean 'credit.estimator'"),
        ("rollout.max_turn=3", "did you mean 'rollout.max_turns'"),
        ("rollout.max_turns=three", "'rollout.max_turns' must be an integer, got 'three'"),
        ("rollout.max_turns=2.5", "must be an integer"),
        ("optim.lr=fast", "'optim.lr' must be a number"),
        ("rollout.engine=vlm", "must be one of \\['hf', 'vllm'\\], got 'vlm'; did you mean 'vllm'"),
        ("logging.jsonl=maybe", "'logging.jsonl' must be true or false"),
        ("credit=grpo", "'credit' is a section"),
        ("rollout.max_turns.x=1", "'rollout.max_turns' is a value, not a section"),
        ("noequals", "must look like key=value"),
        ("optim.batch_prompts=100", "multiple of optim.mini_batch_prompts"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("seed: 1\nrollout:\n  n_samples: 4\n  max_turnz: 3\n")
    with pytest.raises(ConfigError,
                       match=r"bad.yaml line 4: unknown key 'rollout.max_turnz'; did you mean 'rollout.max_turns'"):
        load_config(str(p))
    p.write_text("optim:\n  lr: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line 2: 'optim.lr' must be a number"):
        load_config(str(p))
    p.write_text("rollout: 3\n")
    with pytest.raises(ConfigError, match="line 1: 'rollout' is a section"):
        load_config(str(p))
    p.write_text("rollout: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_config(str(tmp_path / "missing.yaml"))


def _walk(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _walk(hints[f.name], prefix + f.name + ".")


def test_every_field_is_documented():
    missing = [k for k, f in _walk(TrainConfig) if not f.metadata.get("help")]
    assert missing == []


def test_help_lists_every_key():
    text = describe()
    for key in all_keys():
        assert key in text


def test_help_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "fastcredit.prepare", "--help", "all"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0 and "credit.cwgrpo.alpha" in out.stdout


def test_bad_engine_settings_name_the_key():
    with pytest.raises(ConfigError,
                       match="'distributed.engine' must be one of \\['fsdp2', 'deepspeed'\\], got 'zero'"):
        load_config(None, ["distributed.engine=zero"])
    with pytest.raises(ConfigError, match="'distributed.zero_stage' must be one of \\[2, 3\\], got 1"):
        load_config(None, ["distributed.engine=deepspeed", "distributed.zero_stage=1"])
    with pytest.raises(ConfigError, match="distributed.shard_size=2 applies to distributed.engine=fsdp2 only"):
        load_config(None, ["distributed.engine=deepspeed", "distributed.shard_size=2"])
    cfg = load_config(None, ["distributed.engine=deepspeed", "distributed.zero_stage=2"])
    assert (cfg.distributed.engine, cfg.distributed.zero_stage) == ("deepspeed", 2)


def test_a_second_config_overlays_the_first_and_errors_name_its_file(tmp_path):
    """``--config METHOD.yaml --config configs/searchr1_design.yaml``: the overlay changes how a step runs, the
    method config keeps the rest; a bad key in the overlay is named with its file and line."""
    method, design = (os.path.join(ROOT, "configs", f) for f in ("criticsearch.yaml", "searchr1_design.yaml"))
    args = train_parser().parse_args(["--config", method, f"--config={design}", "optim.total_steps=3"])
    path, overrides = args.config, args.overrides
    assert path == [method, design] and overrides == ["optim.total_steps=3"]
    cfg, alone = load_config(path, overrides), load_config(method)
    assert (cfg.rollout.mode, cfg.rollout.stop_at_tags, cfg.rollout.enable_prefix_caching) == \
        ("lockstep", False, False)
    assert (cfg.retrieval.backend, cfg.loss.impl, cfg.optim.total_steps) == ("http", "torch", 3)
    assert cfg.credit.estimator == alone.credit.estimator and cfg.rollout.n_samples == alone.rollout.n_samples
    assert cfg.model.policy == alone.model.policy and cfg.rollout.max_action_tokens == alone.rollout.max_action_tokens
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  mode: lockstep\n  max_turns: 0\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml line 3: rollout\.max_turns must lie in"):
        load_config([method, str(bad)])
