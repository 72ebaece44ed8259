"""A command's line read once, by one parser (fastcredit.config.command_line): help first, the config paths, the
command's own flags and the overrides into one Namespace; each bad word exits 2 with a message that names it. Every
``python -m fastcredit.*`` command builds its parser there, and the training command's --memory-report options are
read from the same Namespace (fastcredit.trainer.build.memory_report_request)."""
import importlib
import os

import pytest

from fastcredit.config.command_line import CommandParser
from fastcredit.trainer.build import memory_report_request, train_parser
from fastcredit.trainer.memory.request import ReportRequest
from tests.config.test_cli_help import ENTRY_POINTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the least each command's line needs (its required flags), so that a bad word is what it refuses
MINIMAL = {"fastcredit.eval": ["--model", "m"], "fastcredit.export": ["--run", "r", "--out", "o"],
           "fastcredit.prm.label": ["--model", "m"], "fastcredit.prm.serve": ["--model", "m"],
           "fastcredit.retrieval.build": ["--corpus", "c", "--out", "o"], "fastcredit.data.toyworld": ["--out", "o"],
           "fastcredit.compare.sweep": ["--point", "1=r.json"]}
# the commands that take a config: --config X.yaml and key=value overrides
TAKE_A_CONFIG = {"fastcredit.train", "fastcredit.eval", "fastcredit.prepare", "fastcredit.prm.train",
                 "fastcredit.prm.label", "fastcredit.compare"}


def _refused(p, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(f"usage: {p.prog}"), err
    return err


def test_one_namespace_from_the_whole_line():
    args = train_parser().parse_args(["--config", "a.yaml", "optim.lr=3", "--resume", "--gpus=8", "--config=b.yaml",
                                      "--gpu-gib", "80", "x.y=1", "--memory-report"])
    assert (args.config, args.overrides) == (["a.yaml", "b.yaml"], ["optim.lr=3", "x.y=1"])
    assert (args.resume, args.profile, args.memory_report, args.gpus, args.gpu_gib) == (True, False, True, 8, 80.0)
    assert train_parser().parse_args(["--config", "a.yaml"]).config == "a.yaml"
    assert train_parser().parse_args([]).config is None


def test_a_default_config_stands_in_for_a_missing_one():
    from fastcredit.compare.runs import parser as compare_parser

    assert compare_parser().parse_args([]).config == os.path.join(ROOT, "configs", "compare.yaml")
    assert compare_parser().parse_args(["--config", "c.yaml"]).config == "c.yaml"


def test_help_is_answered_before_anything_else_is_read(capsys):
    for argv, head in ((["--bogus", "--help", "rollout"], "config keys under 'rollout'"),
                       (["--gpus", "many", "-h"], "usage: python -m fastcredit.train"),
                       (["--help", "optim.lr=3"], "usage: python -m fastcredit.train")):  # an override, not a prefix
        with pytest.raises(SystemExit) as exc:
            train_parser().parse_args(argv)
        assert exc.value.code == 0 and capsys.readouterr().out.startswith(head)


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "error: unknown flag --bogus; overrides are written key=value without dashes"),
    (["--bogus=3", "optim.lr=3"], "error: unknown flag --bogus=3"),
    (["--gpus"], "error: argument --gpus: expected one argument"),
    (["--gpus", "many"], "error: argument --gpus: invalid int value: 'many'"),
    (["--config"], "error: argument --config: expected one argument"),
    (["--resume=yes"], "error: argument --resume: ignored explicit argument 'yes'"),
    (["--res"], "error: unknown flag --res"),  # no abbreviations: a flag is spelt out
    (["rollout"], "error: 'rollout' is neither a flag nor a key=value override"),
    (["--gpus", "8"], "error: --gpus only apply with --memory-report"),
], ids=lambda v: v if isinstance(v, str) else "_".join(v))
def test_a_bad_word_is_named(argv, message, capsys):
    p = train_parser()

    def read(words):
        return memory_report_request(p, p.parse_args(words))

    with pytest.raises(SystemExit) as exc:
        read(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.startswith("usage: python -m fastcredit.train")


def test_the_memory_reports_options_come_from_the_same_namespace():
    p = train_parser()
    assert memory_report_request(p, p.parse_args(["--resume"])) is None
    assert memory_report_request(p, p.parse_args(["--memory-report", "--gpus", "8", "--host-gib=64"])) == \
        ReportRequest(gpus=8, host_gib=64.0)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_reads_its_line_one_way(module, capsys):
    """Each command's ``parser()`` is the shared one: its minimal line parses, a flag it lacks exits 2 naming it, and
    a command that takes a config takes --config and key=value overrides anywhere on its line."""
    mod = importlib.import_module(module + ".runs" if module == "fastcredit.compare" else module)
    p = mod.parser()
    assert isinstance(p, CommandParser) and p.takes_config == (module in TAKE_A_CONFIG)
    line = MINIMAL.get(module, [])
    p.parse_args(line)
    assert "error: unknown flag --bogus" in _refused(p, [*line, "--bogus"], capsys)
    if p.takes_config:
        args = p.parse_args(["a.b=1", *line, "--config", "x.yaml", "c.d=2"])
        assert args.overrides == ["a.b=1", "c.d=2"] and args.config == "x.yaml"
