"""A command's line read once (fastcredit.config.command_line): help first, the config paths, the command's own
flags and the overrides into one object; each bad word a ConfigError that names it. The training command's
--memory-report options are read from that object (fastcredit.trainer.memory.command.report_request)."""
import pytest

from fastcredit.config import CommandLine, ConfigError, parse_command
from fastcredit.train import COMMAND_FLAGS
from fastcredit.trainer.memory.command import report_request


def test_one_object_from_the_whole_line():
    args = parse_command(["--config", "a.yaml", "optim.lr=3", "--resume", "--gpus=8", "--config=b.yaml",
                          "--gpu-gib", "80", "x.y=1"], COMMAND_FLAGS)
    assert args == CommandLine(None, ["a.yaml", "b.yaml"], ["optim.lr=3", "x.y=1"],
                               {"--resume": True, "--gpus": 8, "--gpu-gib": 80.0})
    assert args.has("--resume") and not args.has("--profile")
    assert list(args.flags) == ["--resume", "--gpus", "--gpu-gib"]  # in the order given
    assert parse_command(["--config", "a.yaml"]).config == "a.yaml" and parse_command([]).config is None


def test_help_is_answered_before_anything_else_is_read():
    assert parse_command(["--bogus", "--help", "rollout"], COMMAND_FLAGS) == CommandLine(help="rollout")
    assert parse_command(["--gpus", "many", "-h"], COMMAND_FLAGS) == CommandLine(help="")
    assert parse_command(["--help", "optim.lr=3"], COMMAND_FLAGS).help == ""  # an override, not a prefix


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unknown flag '--bogus'; overrides are written key=value without dashes"),
    (["--gpus"], "--gpus needs a value"),
    (["--gpus", "--resume"], "--gpus needs a value"),
    (["--gpus", "many"], "--gpus: 'many' is not a valid value"),
    (["--config"], "--config needs a YAML path"),
    (["--config", "--resume"], "--config needs a YAML path"),
    (["--resume=yes"], "--resume takes no value"),
], ids=lambda v: v if isinstance(v, str) else "_".join(v))
def test_a_bad_word_is_named(argv, message):
    with pytest.raises(ConfigError) as exc:
        parse_command(argv, COMMAND_FLAGS)
    assert str(exc.value) == message


def test_the_memory_reports_options_come_from_the_same_object():
    assert report_request(parse_command(["--resume"], COMMAND_FLAGS)) is None
    assert report_request(parse_command(["--memory-report", "--gpus", "8"], COMMAND_FLAGS)) == {
        "--gpus": 8, "report": True}
    with pytest.raises(ConfigError, match="--gpus, --host-gib only apply with --memory-report"):
        report_request(parse_command(["--gpus", "8", "--host-gib", "64"], COMMAND_FLAGS))
