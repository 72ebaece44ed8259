"""``--help`` of every command: a usage section of its own (synopsis, flags, examples), config keys by prefix."""
import pytest

from fastcredit import prepare, train
from fastcredit.config import help as cli
from fastcredit.config import ConfigError, all_keys, parse_cli
from fastcredit.retrieval import build, serve


def _help(main, argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_train_help_is_a_usage_section(capsys):
    code, out, _ = _help(train.main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.train")
    for flag in ("--resume", "--profile", "--memory-report", "--config", "examples:", cli.KEYS_POINTER):
        assert flag in out
    assert "credit.cwgrpo.alpha" not in out  # keys only on request
    assert len(out.splitlines()) < 60


def test_each_command_has_its_own_help(capsys):
    train_out = _help(train.main, ["-h"], capsys)[1]
    code, prep_out, _ = _help(prepare.main, ["--help", "--config", "x.yaml"], capsys)
    assert code == 0 and prep_out.startswith("usage: python -m fastcredit.prepare") and prep_out != train_out
    assert "--resume" not in prep_out and "examples:" in prep_out


@pytest.mark.parametrize("prefix", ["rollout", "rollout.proceed", "optim.lr"])
def test_help_prefix_lists_only_its_keys(capsys, prefix):
    code, out, _ = _help(train.main, ["--help", prefix], capsys)
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and " = " in line]
    expected = [k for k in all_keys() if k == prefix or k.startswith(prefix + ".")]
    assert code == 0 and listed == expected and listed
    assert "usage:" not in out


def test_help_all_lists_every_key(capsys):
    code, out, _ = _help(prepare.main, ["--help=all"], capsys)
    assert code == 0 and all(f"  {k} = " in out for k in all_keys())


def test_unknown_prefix_names_close_keys(capsys):
    code, out, err = _help(train.main, ["--help", "rolout"], capsys)
    assert code == 2 and out == "" and "'rolout'" in err and "rollout" in err
    code, _, err = _help(prepare.main, ["--help", "n_samples"], capsys)
    assert code == 2 and "rollout.n_samples" in err


def test_help_request_parsing():
    assert cli.help_request(["a=1"]) is None
    assert cli.help_request(["--help"]) == cli.help_request(["-h", "--config", "x"]) == ""
    assert cli.help_request(["--help", "optim"]) == cli.help_request(["--help=optim"]) == "optim"
    assert cli.help_request(["--help", "optim.lr=3"]) == ""  # an override, not a prefix
    with pytest.raises(ConfigError, match="handle_help"):
        parse_cli(["--help"])


def test_a_command_without_config_keys(capsys):
    text = cli.format_usage("python -m fastcredit.x FILE", "Do x.\n\n    python -m fastcredit.x a\n")
    code, out, _ = _help(lambda argv: cli.handle_help(argv, text, config_keys=False), ["--help", "rollout"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.x FILE") and "config keys" not in out
    assert "examples:\n  python -m fastcredit.x a" in out
    cli.handle_help(["a=1"], text)  # no help asked: returns


@pytest.mark.parametrize("main", [build.main, serve.main], ids=["build", "serve"])
def test_retrieval_commands_show_usage_and_examples(capsys, main):
    code, out, _ = _help(main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.retrieval.")
    assert "examples:" in out and "(default: " in out
