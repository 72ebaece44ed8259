"""One declaration per key across the config trees: a key the PRM trainer's tree shares with the policy's takes its
type, help and range from the schema, with a default of its own; the rules between keys run from one copy."""
import dataclasses
import typing

import pytest

from fastcredit.config import ConfigError, OptimConfig, TrainConfig, load_config
from fastcredit.config.fields import COUNT, opt
from fastcredit.config.help import describe
from fastcredit.config.ranges import field_ranges
from fastcredit.config.share import section, shared
from fastcredit.prm.config import PRMTrainConfig


def _leaves(cls, prefix=""):
    """``{dotted key: (type, field)}`` of every leaf of the config tree ``cls``."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_leaves(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (hints[f.name], f)
    return out


@section
class _Optim:
    lr = shared(OptimConfig, 5e-6, why="a paper's table")
    epochs: int = opt(1, "passes", range=COUNT)
    betas = shared(OptimConfig)


def test_a_shared_key_keeps_its_declaration_and_takes_its_own_default():
    mine, theirs = _leaves(_Optim), _leaves(OptimConfig)
    assert list(mine) == ["lr", "epochs", "betas"]  # the class body's order
    assert mine["lr"][0] is float and mine["lr"][1].metadata["range"] == theirs["lr"][1].metadata["range"]
    assert mine["lr"][1].metadata["help"] == theirs["lr"][1].metadata["help"] + " (default: a paper's table)"
    assert _Optim().lr == 5e-6 and _Optim().betas == OptimConfig().betas
    assert _Optim().betas is not _Optim().betas  # a fresh list per instance
    assert "lr = 5e-06  (float)" in describe(_Optim)


def test_a_key_the_source_does_not_declare_is_an_error():
    with pytest.raises(TypeError, match="OptimConfig declares no key 'learning_rate'"):
        @section
        class _Bad:
            learning_rate = shared(OptimConfig)


def test_the_prm_tree_redeclares_no_key_of_the_policy_tree():
    """Every key both trees hold has one type, one range and one help text (the PRM's may add where its
    default comes from)."""
    prm, policy = _leaves(PRMTrainConfig), _leaves(TrainConfig)
    both = [k for k in prm if k in policy]
    assert len(both) >= 19
    for key in both:
        (tp, f), (tp0, f0) = prm[key], policy[key]
        assert tp == tp0, key
        assert f.metadata.get("range") == f0.metadata.get("range"), key
        assert f.metadata["help"].startswith(f0.metadata["help"]), key
    assert field_ranges(PRMTrainConfig)["optim.lr"] is field_ranges(TrainConfig)["optim.lr"]


def test_the_prm_defaults_are_its_own():
    cfg = PRMTrainConfig()
    assert (cfg.optim.lr, cfg.optim.batch_size, cfg.optim.schedule, cfg.optim.warmup_ratio) == (5e-6, 256, "cosine",
                                                                                                 0.03)
    assert (cfg.optim.weight_decay, cfg.model.tiny_hidden, cfg.model.tiny_heads, cfg.model.tiny_vocab) == (0.0, 64, 2,
                                                                                                          1000)
    assert (cfg.run_name, cfg.data.train_path) == ("fastcredit-prm", "runs/prm_data/train.parquet")
    assert TrainConfig().optim.lr == 1e-6 and TrainConfig().model.tiny_hidden == 128


@pytest.mark.parametrize("override,named", [
    ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), got [0.9]"),
    ("model.tiny_heads=3", "model.tiny_hidden=64 must be a multiple of model.tiny_heads=3"),
    ("distributed.shard_size=2", "distributed.shard_size=2 applies to distributed.engine=fsdp2 only"),
])
def test_both_trees_break_a_shared_rule_with_the_same_message(override, named):
    extra = ["distributed.engine=deepspeed"] if override.startswith("distributed") else []
    for root in (PRMTrainConfig, TrainConfig):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.tiny_hidden=64", override, *extra], root=root)
        assert named in str(err.value), root
