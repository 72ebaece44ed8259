"""Nonsense config values are refused naming the key: every number's range, duplicated YAML keys, missing paths,
an index nobody asked to build, an empty training file, a FlashRAG source without a corpus."""
import dataclasses
import json
import math
import os
import typing
from typing import Optional

import pytest

from fastcredit.data.build import load_data
from fastcredit.retrieval.searcher import make_searcher
from fastcredit.trainer.checks import check_run
from fastcredit.config import ConfigError, TrainConfig, load_config
from fastcredit.config.checks import check_paths
from fastcredit.config.fields import COUNT, opt
from fastcredit.config.ranges import Range, check_ranges, field_ranges
from fastcredit.data.loaders import DataError, QAExample
from fastcredit.prm.config import PRMTrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _numbers(cls, prefix=""):
    """Every int / float key (Optional ones too) and list-of-numbers key of the config, walked here on its own."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numbers(tp, f"{prefix}{f.name}.")
            continue
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if args[0] in (int, float):
            yield prefix + f.name, args[0]
        elif typing.get_origin(args[0]) is list and typing.get_args(args[0])[0] in (int, float):
            yield prefix + f.name, list


NUMBERS = dict(_numbers(TrainConfig))
RANGES = field_ranges(TrainConfig)


def _unmatched(cls) -> tuple[list, list]:
    """(numbers without a range, ranges on a field that holds no number) of the config tree ``cls``."""
    numbers, ranges = set(dict(_numbers(cls))), set(field_ranges(cls))
    return sorted(numbers - ranges), sorted(ranges - numbers)


@pytest.mark.parametrize("root", [TrainConfig, PRMTrainConfig], ids=["train", "prm"])
def test_every_number_declares_a_range_and_only_numbers_do(root):
    missing, stray = _unmatched(root)
    assert missing == [], "a numeric field needs its range: opt(default, help, range=...)"
    assert stray == [], "a range on a field that holds no number"


@dataclasses.dataclass
class _Section:
    ranged: int = opt(1, "a count", range=COUNT)
    bare: float = opt(0.5, "a number without a range")


@dataclasses.dataclass
class _Tree:
    seed: Optional[int] = opt(None, "a seed without a range")
    section: _Section = opt(_Section, "a section")


@dataclasses.dataclass
class _Stray:
    name: str = opt("x", "a name with a range", range=COUNT)


def test_a_number_without_a_range_is_found():
    assert _unmatched(_Tree) == (["section.bare", "seed"], [])
    assert _unmatched(_Stray) == ([], ["name"])


def test_a_range_is_declared_with_its_field():
    f = {f.name: f for f in dataclasses.fields(_Section)}
    assert f["ranged"].metadata["range"] == Range("[1, inf)") and "range" not in f["bare"].metadata
    top_k = opt(-1, "top-k (-1: off)", range=COUNT, also=(-1,), note="-1: off")
    assert top_k.metadata == {"help": "top-k (-1: off)", "range": Range("[1, inf)", "-1: off", (-1,))}
    with pytest.raises(ValueError, match="is not an interval"):
        opt(1, "x", range="1 to 3")
    with pytest.raises(TypeError, match="give range too"):
        opt(1, "x", note="0: off")
    with pytest.raises(TypeError, match="in the Range"):
        opt(1, "x", range=Range(COUNT), note="0: off")


def test_check_ranges_names_the_key_its_origin_or_a_label():
    tree = _Tree(section=_Section(ranged=0))
    with pytest.raises(ConfigError, match=r"^x.yaml line 3: section.ranged must lie in \[1, inf\), got 0$"):
        check_ranges(tree, {"section.ranged": "x.yaml line 3"})
    with pytest.raises(ConfigError, match=r"^the tree: section.ranged must lie in"):
        check_ranges(tree, label="the tree")
    check_ranges(_Tree(seed=-5, section=_Section(bare=math.nan)))  # no range declared: nothing to check


def _bad_values(key):
    """Values outside ``RANGES[key]``: NaN, the infinities it does not allow, just past each finite end, huge."""
    rng, tp = RANGES[key], NUMBERS[key]
    lo_closed, lo, hi, hi_closed = rng.bounds
    step = 1 if tp is int else 0.5
    bad = [math.nan]
    if not (hi == math.inf and hi_closed):
        bad.append(math.inf)
    if not (lo == -math.inf and lo_closed):
        bad.append(-math.inf)
    if math.isfinite(lo):
        bad += [lo - step if lo_closed else lo, -1e300]
    if math.isfinite(hi):
        bad += [hi + step if hi_closed else hi, 1e300]
    if tp is int:
        bad += [2 ** 64, -(2 ** 64)]
    return [v for v in bad if v not in rng.also]


def _text(key, value):
    text = {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan" if value != value else repr(value))
    return f"[{text}, 0.9]" if NUMBERS[key] is list else text


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_number_out_of_range_is_refused_naming_the_key(key):
    for value in _bad_values(key):
        item = f"{key}={_text(key, value)}"
        with pytest.raises(ConfigError, match=f"'?{key}'? ") as err:
            load_config(None, [item])
        assert f"command line '{item}'" in str(err.value)


@pytest.mark.parametrize("item, message", [
    ("optim.grad_clip=-1", r"optim.grad_clip must lie in \(0, inf\] \(inf: no clipping\), got -1.0"),
    ("optim.grad_clip=0", "optim.grad_clip must lie in"),
    ("optim.total_steps=-3", r"optim.total_steps must lie in \[0, inf\), got -3"),
    ("rollout.temperature=inf", r"rollout.temperature must lie in \(0, inf\)"),
    ("rollout.temperature=0", "training divides the logits by it"),
    ("rollout.max_action_tokens=0", r"rollout.max_action_tokens must lie in \[1, inf\), got 0"),
    ("eval.questions=-1", r"eval.questions must lie in \[0, inf\) \(0: no evaluation\), got -1"),
    ("optim.lr=nan", "optim.lr must lie in"),
    ("optim.betas=[0.9, 1.0]", r"optim.betas must lie in \[0, 1\) \(each of the two\), got \[0.9, 1.0\]"),
    ("optim.betas=[0.9]", "optim.betas must be two numbers"),
    ("optim.betas=[x, 0.9]", "'optim.betas' must be a number"),
    ("optim.betas=[0.9, nan]", r"optim.betas must lie in \[0, 1\) \(each of the two\), got \[0.9, nan\]"),
    ("rollout.top_k=0", r"rollout.top_k must lie in \[1, inf\) \(-1: off\), got 0"),
    ("seed=4294967296", "seed must lie in"),
    ("model.tiny_heads=3", "model.tiny_hidden=128 must be a multiple of model.tiny_heads=3"),
    ("data.toy.num_cities=3", r"data.toy: num_cities \(3\) must be at least num_countries \(30\)"),
    ("retrieval.build_index=never", "retrieval.build_index=never needs retrieval.index"),
    ("rollout.tensor_parallel=2", "rollout.tensor_parallel=2: each rank's rollout engine runs in the trainer's"),
])
def test_the_issues_nonsense_values_are_refused(item, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [item])


def test_meaningful_specials_are_accepted():
    cfg = load_config(None, ["optim.grad_clip=inf", "guard.max_kl=inf", "guard.min_reward=-inf", "rollout.top_k=-1",
                             "optim.total_steps=0", "eval.questions=0", "logging.keep_checkpoints=0",
                             "judges.temperature=0", "loss.dual_clip=3", "optim.critic_warmup_ratio=null",
                             "retrieval.num_shards=0"])
    assert math.isinf(cfg.optim.grad_clip) and cfg.rollout.top_k == -1 and cfg.optim.critic_warmup_ratio is None
    with pytest.raises(ConfigError, match=r"distributed.shard_size must lie in \[1, inf\) \(-1: all ranks\), got 0"):
        load_config(None, ["distributed.shard_size=0"])


def test_a_kept_training_state_with_vllm_needs_a_fixed_share():
    """distributed.offload_state=false keeps the training state beside vLLM, whose automatic share would be measured
    before the optimizer state exists: a fixed share is asked for; the HF engine, or no colocation, needs none."""
    keep = ["distributed.offload_state=false", "rollout.engine=vllm"]
    with pytest.raises(ConfigError, match="distributed.offload_state=false with rollout.engine=vllm needs a fixed "
                                          "rollout.gpu_memory_utilization"):
        load_config(None, keep)
    assert load_config(None, [*keep, "rollout.gpu_memory_utilization=0.4"]).distributed.offload_state is False
    assert load_config(None, ["distributed.offload_state=false", "rollout.engine=hf"]).rollout.engine == "hf"
    assert load_config(None, [*keep, "distributed.colocate=false"]).distributed.colocate is False
    # the default decides at start from the GPU; when it keeps the state, the memory plan gives vLLM's share
    assert load_config(None, ["rollout.engine=vllm"]).distributed.offload_state == "auto"
    assert load_config(None, ["rollout.engine=vllm", "distributed.offload_state=true"]).distributed.offload_state


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("true", True), ("false", False), ("True", True),
                                         ("off", False)])
def test_offload_state_takes_auto_true_false_from_yaml_and_the_command_line(tmp_path, text, value):
    """A Literal mixing a name with bools: the name verbatim, the rest as YAML reads it (yes / off are bools there
    as for every bool key); the value keeps its type (the string "true" would be truthy as a bool is)."""
    p = tmp_path / "x.yaml"
    p.write_text(f"distributed:\n  offload_state: {text}\n")
    for cfg in (load_config(str(p)), load_config(None, [f"distributed.offload_state={text}"])):
        assert cfg.distributed.offload_state == value and type(cfg.distributed.offload_state) is type(value)


@pytest.mark.parametrize("text, got", [("maybe", "'maybe'"), ("1", "1"), ("Auto", "'Auto'; did you mean 'auto'?"),
                                       ("'true'", "'true'"), ("null", "None")])
def test_offload_state_refuses_anything_else_naming_the_key(tmp_path, text, got):
    valid = "'distributed.offload_state' must be one of ['auto', true, false], got "
    p = tmp_path / "x.yaml"
    p.write_text(f"distributed:\n  offload_state: {text}\n")
    with pytest.raises(ConfigError, match=f"x.yaml line 2: {valid}".replace("[", r"\[").replace("]", r"\]")):
        load_config(str(p))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"distributed.offload_state={text}"])
    assert f"command line 'distributed.offload_state={text}': {valid}{got}" in str(err.value)


def test_a_range_error_names_the_yaml_line(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("seed: 1\noptim:\n  lr: 1.0e-3\n  grad_clip: -1\n")
    with pytest.raises(ConfigError, match=r"x.yaml line 4: optim.grad_clip must lie in \(0, inf\]"):
        load_config(str(p))


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lr: 1.0e-3\nseed: 1\noptim:\n  lr: 1.0e-6\n", "'optim' is given twice, at lines 1 and 4"),
    ("optim:\n  lr: 1.0e-3\n  grad_clip: 1.0\n  lr: 1.0e-6\n", "'optim.lr' is given twice, at lines 2 and 4"),
    ("credit:\n  cwgrpo:\n    alpha: 1\n    alpha: 2\n", "'credit.cwgrpo.alpha' is given twice, at lines 3 and 4"),
    ("optim: {lr: 1.0e-3, lr: 1.0e-6}\n", "'optim.lr' is given twice, at lines 1 and 1"),
    ("seed: 1\nseed: 1\n", "'seed' is given twice, at lines 1 and 2"),
])
def test_a_key_given_twice_in_yaml_names_both_lines(tmp_path, text, message):
    p = tmp_path / "x.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"x.yaml: {message}"):
        load_config(str(p))


def test_the_same_key_in_different_sections_is_no_duplicate(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("optim:\n  lr: 1.0e-3\nwarmstart:\n  lr: 1.0e-3\n")
    assert load_config(str(p)).optim.lr == 1e-3


@pytest.mark.parametrize("override, part, message", [
    ("model.policy=/x/y", "model",
     r"model.policy: /x/y does not exist \(a local Hugging Face folder, 'tiny' or 'smollm2'\)"),
    ("model.tokenizer=/x/tok", "model", "model.tokenizer: /x/tok does not exist"),
    ("retrieval.corpus=/x/c.jsonl", "retrieval", "retrieval.corpus: /x/c.jsonl does not exist"),
    ("retrieval.encoder=/x/e5", "retrieval", r"retrieval.encoder: /x/e5 does not exist \('minilm' or"),
    ("judges.model=/x/judge", "judges", "judges.model: /x/judge does not exist"),
])
def test_missing_paths_name_their_key(override, part, message):
    cfg = load_config(None, [override, "judges.backend=colocated"])
    with pytest.raises(ConfigError, match=message) as err:
        check_paths(cfg, part)
    assert isinstance(err.value, FileNotFoundError)  # callers that catch OSError (the export) still do
    check_paths(load_config(None, []))  # the defaults name nothing local


def test_a_missing_model_folder_fails_before_transformers_sees_it(tmp_path):
    """The training command's one check of the run's config (before the process group starts and anything
    loads), not a library's traceback taking the folder for a hub id."""
    cfg = load_config(None, ["model.policy=/x/y", f"logging.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="model.policy: /x/y does not exist"):
        check_run(cfg)
    assert not (tmp_path / "run").exists()


def test_a_missing_index_is_not_built_unless_asked(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"T\\"\\nx"}\n')
    index = str(tmp_path / "e5_Flat.index")
    cfg = load_config(None, [f"retrieval.corpus={corpus}", f"retrieval.index={index}", "retrieval.encoder=minilm",
                             "retrieval.query_prefix=query: "])
    with pytest.raises(ConfigError, match=r"retrieval.index: .*e5_Flat.index does not exist, and with "
                                          r"retrieval.build_index=auto nothing builds it") as err:
        make_searcher(cfg, None, str(corpus))
    message = str(err.value)
    build = f"python -m fastcredit.retrieval.build --corpus {corpus} --out {tmp_path}/e5_Flat --query-prefix 'query: '"
    assert build in message and "retrieval.build_index=missing" in message
    from fastcredit.retrieval.retriever import from_config

    with pytest.raises(ConfigError, match="e5_Flat.index does not exist"):  # the library entry point too
        from_config(cfg.retrieval, corpus=str(corpus))
    check_paths(load_config(None, [f"retrieval.corpus={corpus}", f"retrieval.index={index}",
                                   "retrieval.build_index=missing"]), "retrieval")


def _qa_file(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(QAExample(f"q{i}", "q", ["a"], "nq").to_record()) + "\n")
    return str(path)


def test_an_empty_training_file_is_a_data_error_naming_it(tmp_path):
    train = _qa_file(tmp_path / "train.jsonl", 0)
    cfg = load_config(None, ["data.source=flashrag", f"data.train_path={train}"])
    with pytest.raises(DataError, match=f"{train}: no training questions"):
        load_data(cfg)


def test_a_flashrag_source_without_a_corpus_names_retrieval_corpus(tmp_path):
    cfg = load_config(None, ["data.source=flashrag", f"data.train_path={_qa_file(tmp_path / 'train.jsonl', 2)}"])
    with pytest.raises(ConfigError, match="data.source=flashrag needs retrieval.corpus"):
        load_data(cfg)
    # a missing file is named by its key in the run's one check (check_paths, before anything loads), and by its
    # path if the loader is called without it
    missing_test = load_config(None, ["data.source=flashrag", f"data.train_path={tmp_path}/train.jsonl",
                                      "data.test_path=/x/test.jsonl"])
    with pytest.raises(ConfigError, match="data.test_path: /x/test.jsonl does not exist"):
        check_paths(missing_test, "data")
    with pytest.raises(DataError, match="/x/test.jsonl: no such file"):
        load_data(missing_test)
    with pytest.raises(ConfigError, match="data.train_path: /x/train.parquet does not exist"):
        check_paths(load_config(None, ["data.source=searchr1", "data.train_path=/x/train.parquet"]), "data")
