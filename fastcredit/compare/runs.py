"""Every method from the same warm start, several seeds, one table: the papers' claim at toy scale.

    python -m fastcredit.compare --config configs/compare.yaml --seeds 3 \\
        --methods grpo,ppo,criticsearch,cwgrpo,proceed,pica
    python -m fastcredit.compare --config configs/compare.yaml --quick          # 1 seed, half the steps
    python -m fastcredit.compare --config configs/compare.yaml --jobs 2        # two runs side by side
    nohup python -m fastcredit.compare --config configs/compare.yaml > runs/compare.log 2>&1 &   # in the background
    python -m fastcredit.compare --config configs/compare_starved.yaml --methods grpo,gigpo,criticsearch,pica \\
        --seeds 6 --noise 0 --jobs 2        # the powered comparison (docs/results.md), resumable across sessions
    python -m fastcredit.compare --config configs/compare_starved.yaml --methods grpo,gigpo,igsearch \\
        --seeds 6 --noise 0 --jobs 2        # IG-Search against GRPO and GiGPO on the same preset

One warm start is made (or loaded: ``warmstart.cache_dir``) and shared by every run; then each
method trains for the same steps, prompts and samples with the toy world's oracle judges, and,
for the methods that have a judge, once more with a noisy oracle (``--noise p``: each verdict
flipped with probability p, ``judges.oracle_noise``). Runs go one after another (``--jobs N``: N
at a time once the first has made the world, index and warm start, the cores shared out among
them), each a ``python -m fastcredit.train`` process with its own folder under ``--runs``; a finished run is
not redone and an interrupted one resumes from its last checkpoint, so the command can simply
be started again (a run found there that was made with other settings is an error, exit 2); runs go seed by
seed, every method of a seed before the next seed, so a comparison stopped part-way has whole seeds to pair.
The report (``fastcredit.compare.report``) goes to ``<out>/compare_<name>_<device>.{md,json,png}``:
held-out EM per method (mean ± 95% interval over seeds), the difference to GRPO paired by seed,
steps to reach a threshold EM, how often the credit goes against the outcome, seconds per step
and judge calls per step; the credit accuracy per turn; what the sampled policy does at the start and at the end
(searches, turns and tokens per trajectory, sampled EM, well-formed share).
Exit status: 0 done, 1 a run failed (its log is named), 2 bad arguments or config.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

from fastcredit.compare.report import read_metrics, summarize_run
from fastcredit.config import ConfigError, command_parser, config_drift, load_config
from fastcredit.runtime.profiling import device_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: configs/, bench/
# What each method adds to the shared config: its estimator and the judge it reads (the oracle on the toy world).
# ProCeedRL runs without DAPO's dynamic sampling here, so every method sees the same prompts per step. PPO and PiCA
# whiten their GAE advantages over the batch, as veRL (Search-R1's and PiCA's trainer) always does; GiGPO matches
# similar anchor states at verl-agent's search-recipe threshold (configs/gigpo.yaml). IG-Search needs no judge: the
# policy scores the gold answer after each search itself (docs/methods.md §11).
METHODS = {
    "grpo": ["credit.estimator=grpo"],
    "ppo": ["credit.estimator=ppo", "credit.whiten_advantages=true"],
    "criticsearch": ["credit.estimator=criticsearch", "judges.backend=oracle"],
    "cwgrpo": ["credit.estimator=cwgrpo", "judges.backend=oracle"],
    "proceed": ["credit.estimator=proceed", "rollout.proceed.enabled=true", "judges.backend=oracle"],
    "pica": ["credit.estimator=pica", "judges.prm=oracle", "credit.whiten_advantages=true"],
    "gigpo": ["credit.estimator=gigpo", "credit.gigpo.match=similar", "credit.gigpo.threshold=0.9"],
    "igsearch": ["credit.estimator=igsearch"],
}
JUDGED = ("criticsearch", "cwgrpo", "proceed", "pica")
QUICK_STEP_SHARE = 0.5  # --quick: this share of optim.total_steps, one seed


SPLIT = "distributed.placement=split"


def variants(methods: list[str], noise: float, staleness: tuple = ()) -> list[tuple[str, list[str]]]:
    """``(label, overrides)`` per run kind: each method, then each judged one with a noisy oracle, then each method
    under the split placement at each staleness bound k (``<method>+split-k<k>``, 2 ranks under torchrun)."""
    out = [(m, METHODS[m]) for m in methods]
    if noise > 0:
        out += [(f"{m}+noise{noise:g}", METHODS[m] + [f"judges.oracle_noise={noise}"]) for m in methods if m in JUDGED]
    out += [(f"{m}+split-k{k}", METHODS[m] + [SPLIT, f"rollout.max_staleness={k}"]) for m in methods for k in staleness]
    return out


def train_command(config: str, overrides: list[str]) -> list[str]:
    """The run's command: ``python -m fastcredit.train``, or under torchrun with 2 ranks (a training and a rollout
    rank) for the split placement."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if SPLIT in overrides else []
    return [sys.executable, *launcher, "-m", "fastcredit.train", "--config", config, *overrides]


def parser() -> argparse.ArgumentParser:
    """The command's line: the shared config and its overrides, the methods, seeds and variants, where runs go."""
    p = command_parser("python -m fastcredit.compare", __doc__,
                       config="the shared run config (default: configs/compare.yaml)",
                       config_default=os.path.join(ROOT, "configs", "compare.yaml"))
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method (the config's seed, +1, +2, ...)")
    p.add_argument("--noise", type=float, default=0.2, help="noisy-oracle variants of the judged methods (0: none)")
    share = f"{QUICK_STEP_SHARE:.0%}".replace("%", "%%")  # argparse %-formats help texts
    p.add_argument("--quick", action="store_true", help=f"1 seed and {share} of the steps")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time once the warm start is made (seconds per step are then measured side by "
                        "side); on a 2-core machine --jobs 2 keeps both cores busy")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of each run (default 1): float sums follow the thread count, so a fixed count "
                        "gives the same runs on any machine; the report's name carries it")
    p.add_argument("--runs", default=None,
                   help="folder of the runs (default: runs/<run_name>, runs/<run_name>_quick with --quick); "
                        "a run kept there must have been made with the settings this command gives it")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                   help="where the report goes (default: bench/results)")
    p.add_argument("--threshold", type=float, default=None,
                   help="EM for 'steps to threshold' (default: GRPO's final mean EM, or the first method's)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from finished runs")
    p.add_argument("--staleness", default="", help="also each method under the split placement at these "
                                                    "rollout.max_staleness values (e.g. 0,1,2; 2 ranks each)")
    return p


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    """The command line ``argv`` (None: the process's) read and checked: ``(args, the config overrides)``."""
    p = parser()
    args = p.parse_args(argv)
    overrides = args.overrides
    if not isinstance(args.config, str):
        p.error("--config is given once: every run of the comparison starts from that one file")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        p.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; valid: {', '.join(METHODS)}")
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if not all(k.strip().isdigit() for k in args.staleness.split(",") if k.strip()):
        p.error(f"--staleness takes comma-separated whole numbers, got {args.staleness!r}")
    args.staleness = tuple(int(k) for k in args.staleness.split(",") if k.strip())
    if not 0.0 <= args.noise <= 1.0:
        p.error(f"--noise must be in [0, 1], got {args.noise}")
    args.methods = methods
    # the runs start in the checkout's folder: paths given relative to where the command was started are made whole
    args.config, args.out = os.path.abspath(args.config), os.path.abspath(args.out)
    if args.runs is not None:
        args.runs = os.path.abspath(args.runs)
    if args.quick:
        args.seeds = 1
    return args, overrides


# Lines of a run's console that are its step table (header and rows) or a progress bar's redraws: not relayed.
_TABLE_LINE = re.compile(r"^\s*(step\s|\d+\s)|\r")


class _LogTail:
    """The status lines (index build, warm start, held-out EM, errors) a run's log gains, printed as they come."""

    def __init__(self, path: str, label: str):
        self.fh = open(path, encoding="utf-8", errors="replace", newline="")  # newline="": a bar's \r stays visible
        self.fh.seek(0, os.SEEK_END)
        self.label, self.partial = label, ""

    def relay(self, final: bool = False) -> None:
        lines = (self.partial + self.fh.read()).split("\n")
        self.partial = "" if final else lines.pop()  # a line still being written waits for its end
        for line in lines:
            if line.strip() and not _TABLE_LINE.search(line) and not line.startswith("$ "):
                print(f"  {self.label}: {line.rstrip()}", flush=True)

    def close(self) -> None:
        self.fh.close()


class _Run:
    """One training run in a subprocess, its output in ``folder/train.log``; :meth:`poll` prints its progress
    (steps from metrics.jsonl, status lines from the log) and, once it has ended, writes ``result.json``."""

    def __init__(self, cmd: list[str], folder: str, label: str, seed: int, total_steps: int, tag: str,
                 threads: int):
        os.makedirs(folder, exist_ok=True)
        self.folder, self.label, self.seed, self.total, self.tag = folder, label, seed, total_steps, tag
        self.threads = threads
        self.log = os.path.join(folder, "train.log")
        self.metrics = os.path.join(folder, "metrics.jsonl")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        self.out = open(self.log, "a", encoding="utf-8")
        self.tail = _LogTail(self.log, f"{label} seed {seed}")
        self.out.write(f"\n$ {' '.join(cmd)}\n")
        self.out.flush()
        self.t0, self.last = time.time(), -1
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def ready(self) -> bool:
        """Whether the run has written metrics (its world, index and warm start exist by then)."""
        return os.path.exists(self.metrics) and os.path.getmtime(self.metrics) >= self.t0

    def stop(self) -> None:
        """End the run (it resumes from its last checkpoint when the command is started again)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tail.close()
        self.out.close()
        print(f"{self.tag} {self.label} seed {self.seed}: stopped at step {max(self.last, 0)}", flush=True)

    def poll(self) -> Optional[int]:
        """None while the run goes on; then its exit status (0: ``result.json`` written)."""
        rc = self.proc.poll()
        self.tail.relay(final=rc is not None)
        done = summarize_run(read_metrics(self.metrics))["steps"] if os.path.exists(self.metrics) else 0
        if done != self.last:
            print(f"  {self.label} seed {self.seed}: step {done}/{self.total}", flush=True)
            self.last = done
        if rc is None:
            return None
        self.tail.close()
        self.out.close()
        if rc == 0:
            summary = summarize_run(read_metrics(self.metrics))
            summary.update(method=self.label, seed=self.seed, wall_s=time.time() - self.t0,
                           device=device_name(threads=self.threads))
            result = os.path.join(self.folder, "result.json")
            with open(result + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(summary, fh, indent=1)
            os.replace(result + ".tmp", result)
            em = summary["eval_em"].get(str(summary["steps"]))
            print(f"{self.tag} {self.label} seed {self.seed}: "
                  f"held-out EM {'not evaluated' if em is None else f'{em:.3f}'}"
                  f" after {summary['steps']} steps, {time.time() - self.t0:.0f} s", flush=True)
        return rc


# Where a run's files go: the same run may name them differently (a relative or an absolute --runs), so they are
# not compared.
_PATH_KEYS = ("logging.output_dir", "warmstart.cache_dir", "data.world_dir")


def saved_run_drift(saved: str, expected) -> list[str]:
    """``key: saved → expected`` for each setting where the run config saved at ``saved`` (if any) differs from the
    config this command gives that run (paths aside)."""
    if not os.path.exists(saved):
        return []
    return config_drift(load_config(saved), expected, ignore=_PATH_KEYS)


def run_all(args, overrides: list[str], cfg) -> Optional[str]:
    """Every (variant, seed) run not finished yet, ``args.jobs`` at a time once the first has made what they share;
    returns the log of a run that failed (the others started still finish), None when all finished."""
    total = cfg.optim.total_steps if not args.quick else max(1, int(cfg.optim.total_steps * QUICK_STEP_SHARE))
    cache = os.path.join(args.runs, "warmstart")
    # every seed starts from the warm start of the config's seed (made by the first run, loaded by the others) and
    # is scored on the held-out questions that seed picks
    shared = [*overrides, f"optim.total_steps={total}", "logging.progress=false",
              f"warmstart.seed={cfg.warmstart.seed_for(cfg.seed)}", f"warmstart.cache_dir={cache}",
              f"eval.seed={cfg.eval.seed_for(cfg.seed)}"]
    threads = args.threads
    # seed by seed, every method within a seed: a comparison stopped part-way (and resumed in another session) has
    # whole seeds to pair
    todo = [(label, extra, cfg.seed + k) for k in range(args.seeds)
            for label, extra in variants(args.methods, args.noise, args.staleness)]
    pending, running, failed, ready = [], [], None, False
    for i, (label, extra, seed) in enumerate(todo, 1):
        folder = os.path.join(args.runs, label, f"seed{seed}")
        run_overrides = [*shared, *extra, f"seed={seed}", f"run_name={cfg.run_name}-{label}-seed{seed}",
                         f"logging.output_dir={folder}"]
        drift = saved_run_drift(os.path.join(folder, "config.yaml"), load_config(args.config, run_overrides))
        if drift:
            raise ConfigError(f"{folder} holds a run made with other settings ({'; '.join(drift[:5])}"
                              f"{'; …' if len(drift) > 5 else ''}): keep it apart with another --runs folder, or "
                              f"delete it to redo it")
        if os.path.exists(os.path.join(folder, "result.json")):
            print(f"[{i}/{len(todo)}] {label} seed {seed}: done before, kept", flush=True)
        else:
            pending.append((f"[{i}/{len(todo)}]", label, run_overrides, seed, folder))
    try:
        while pending or running:
            # one run at a time until a run has written metrics: the shared world, index and warm start are then on
            # disk, made once
            ready = ready or any(r.ready() for r in running)
            slots = args.jobs if ready else 1
            while pending and failed is None and len(running) < slots:
                tag, label, run_overrides, seed, folder = pending.pop(0)
                cmd = train_command(args.config, run_overrides)
                ckpt = os.path.join(folder, "checkpoints")
                if os.path.isdir(ckpt) and os.listdir(ckpt):
                    cmd.append("--resume")
                print(f"{tag} {label} seed {seed}{' (resuming)' if '--resume' in cmd else ''}", flush=True)
                # a split run's two ranks share its threads
                each = threads if SPLIT not in run_overrides else max(1, threads // 2)
                running.append(_Run(cmd, folder, label, seed, total, tag, each))
            if failed is not None and not running:
                break
            _wait_for_an_end(running, 2.0)
            for run in list(running):
                rc = run.poll()
                if rc is not None:
                    running.remove(run)
                    ready = ready or rc == 0
                    failed = failed or (run.log if rc != 0 else None)
    finally:  # interrupted (Ctrl-C, SIGTERM): no run is left training unseen; each resumes from its checkpoint
        for run in running:
            run.stop()
    return failed


def _wait_for_an_end(running: list, seconds: float) -> None:
    """Sleep ``seconds`` between progress reports, but no longer than it takes one of ``running`` to end (the next
    run starts at once)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and all(run.proc.poll() is None for run in running):
        time.sleep(0.1)


@contextlib.contextmanager
def runs_lock(runs: str):
    """Hold ``<runs>/.lock`` while runs go: a second command on the same folder would train the same runs twice."""
    os.makedirs(runs, exist_ok=True)
    with open(os.path.join(runs, ".lock"), "a+", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise ConfigError(f"{runs} is in use by another python -m fastcredit.compare "
                              f"({fh.read().strip() or 'pid ?'}); "
                              f"wait for it, or give this one another --runs folder") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}\n")
        fh.flush()
        yield


def main(argv: Optional[list] = None) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if cfg.data.source != "toy":
        print(f"config error: {args.config}: the comparison uses the toy world's oracle judges; data.source must be "
              f"toy, got {cfg.data.source!r}", file=sys.stderr)
        return 2
    args.runs = args.runs or os.path.abspath(os.path.join("runs", cfg.run_name + ("_quick" if args.quick else "")))
    if not args.report_only:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` stops the runs too (run_all's finally)
        try:
            with runs_lock(args.runs):
                failed = run_all(args, overrides, cfg)
        except ConfigError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        if failed is not None:
            print(f"error: a run failed; see {failed} (start the command again to resume)", file=sys.stderr)
            return 1
    from fastcredit.compare.report import write_report

    # a comparison with split-placement variants is a report of its own, beside the preset's
    name = os.path.splitext(os.path.basename(args.config))[0] + ("_quick" if args.quick else "") + \
        ("_split" if args.staleness else "")
    labels = [label for label, _ in variants(args.methods, args.noise, args.staleness)]
    setting = f"{args.jobs} runs side by side" if args.jobs > 1 else ""
    paths = write_report(args.runs, labels, args.out, name, args.threshold, setting)
    print("\n".join(["report:", *paths]))
    return 0
