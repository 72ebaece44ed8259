"""``--help`` of every command: a usage section of its own (synopsis, prose, flags, examples), config keys by
prefix, in one layout (fastcredit.config.command_line's parser)."""
import pytest

from fastcredit import prepare, train
from fastcredit.config import all_keys, command_parser
from fastcredit.config.command_line import help_request
from fastcredit.config.help import KEYS_POINTER
from fastcredit.prm import train as prm_train
from fastcredit.prm.config import PRMTrainConfig
from fastcredit.retrieval import build, serve


def _help(main, argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_train_help_is_a_usage_section(capsys):
    code, out, _ = _help(train.main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.train")
    for flag in ("--resume", "--profile", "--memory-report", "--config", "key=value", "examples:", KEYS_POINTER):
        assert flag in out
    assert "credit.cwgrpo.alpha" not in out  # keys only on request
    assert len(out.splitlines()) < 60 and max(len(line) for line in out.splitlines()) <= 120


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


def test_a_prm_run_lists_its_own_keys(capsys):
    code, out, _ = _help(prm_train.main, ["--help", "prm.tau"], capsys)
    assert code == 0 and "prm.tau_g = " in out and "rollout." not in out
    assert all(k.startswith("prm.tau") for k in all_keys(PRMTrainConfig) if f"  {k} = " in out)
    code, _, err = _help(prm_train.main, ["--help", "rollout"], capsys)
    assert code == 2 and "no config key starts with 'rollout'" in err


def test_help_request_parsing():
    assert help_request(["a=1"]) is None
    assert help_request(["--help"]) == help_request(["-h", "--config", "x"]) == ""
    assert help_request(["--help", "optim"]) == help_request(["--help=optim"]) == "optim"
    assert help_request(["--help", "optim.lr=3"]) == ""  # an override, not a prefix


def test_a_command_without_config_keys(capsys):
    p = command_parser("python -m fastcredit.x", "Do x.\n\n    python -m fastcredit.x a\n")
    p.add_argument("--file", required=True, help="what to do x to")
    code, out, _ = _help(p.parse_args, ["--help", "rollout"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.x") and "config keys" not in out
    assert "examples:\n  python -m fastcredit.x a" in out and "--file FILE" in out
    assert p.parse_args(["--file", "f"]).file == "f"  # no help asked: the line is read


@pytest.mark.parametrize("main", [build.main, serve.main], ids=["build", "serve"])
def test_retrieval_commands_show_usage_and_examples(capsys, main):
    code, out, _ = _help(main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m fastcredit.retrieval.")
    assert "examples:" in out and "(default: " in out


def _entry_points() -> list:
    """Every ``python -m`` command of the package: a module with a ``__main__`` guard, or a package's ``__main__``."""
    import ast
    import os

    import fastcredit

    root = os.path.dirname(fastcredit.__file__)
    found = []
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            mod = "fastcredit." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            if f == "__main__.py":
                found.append(mod.rsplit(".", 1)[0])
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
                found.append(mod)
    return sorted(found)


ENTRY_POINTS = _entry_points()


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_prints_its_help(module, monkeypatch, capsys):
    """``python -m <command> --help`` exits 0 with a usage line (argparse %-formats help texts: a bare % crashed
    compare's); found by walking the package, so a new command is covered without editing this test."""
    import runpy
    import warnings

    monkeypatch.setattr("sys.argv", [module, "--help"])
    with pytest.raises(SystemExit) as exc, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, by another test
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err[-2000:]
    assert out.out.startswith(f"usage: python -m {module}"), module
    assert "\noptions:\n" in out.out or "\nconfig:\n" in out.out, module  # argparse's layout, one for all
