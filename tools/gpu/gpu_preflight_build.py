"""The GPU path of ``make env`` on a machine without a GPU: build ``fastcredit._C`` against a CUDA build of torch
with the Makefile's own build command, then run the Makefile's own import line in a fresh process.

    python -m tools.gpu.gpu_preflight_build OUTDIR     # any Python >= 3.11 (stdlib only); OUTDIR/build.{json,log}

PyPI's Linux torch wheels are CUDA builds that import without a GPU, so this catches a build or load failure
before a GPU machine is spent on it. Steps, with progress on stdout and every command's output in build.log:

1. venv: a CUDA torch in its own venv, ``$FASTCREDIT_CUDA_VENV`` (default ``~/.cache/fastcredit/cuda-venv``),
   created once and reused: a stamp in it names what was installed (``$FASTCREDIT_CUDA_TORCH``, default
   ``torch==2.14.1``, and the build tools), so a later run skips the install. About 5.5 GB.
2. copy: tracked and untracked-but-not-ignored files into a scratch folder; an editable build writes
   ``fastcredit/_C*.so`` into the tree it builds, and the CPU venv must never load one from the checkout.
3. build, import: the Makefile's two lines, read from the Makefile itself, with ``$(PY)`` the venv's python,
   ``CUDA_HOME`` (default /usr/local/cuda) set, and the import run without LD_LIBRARY_PATH or PYTHONPATH.
4. inspect: ``readelf -d`` on the .so (RPATH, RUNPATH, NEEDED); in a fresh process, which libcudart the import
   mapped (one copy, torch's), the ops registered under ``torch.ops.fastcredit``, and ``merge_topk`` on CPU
   tensors, which must raise a clean error (a Python exception, not a crash).

Exit status 1 when any step fails; build.json's ``status`` and ``failed_step`` say which. The scratch tree is
removed after a passing run and kept (its path in build.json) after a failing one.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "fastcredit", "cuda-venv")
DEFAULT_TORCH = "torch==2.14.1"
# The Makefile's first install line: with the pip that Python 3.11 bundles (23.2), `pip install -e .` runs
# `setup.py develop`, which today's setuptools turns into an isolated build where torch cannot be imported.
PIP_TOOLS = ["pip>=24", "setuptools>=70", "wheel"]
# What else the build needs; the Makefile's build step runs with --no-deps, so nothing more is installed.
BUILD_TOOLS = ["ninja", "numpy", "pyyaml"]
STAMP = ".fastcredit-preflight.json"
HEARTBEAT_S = 30

# Runs in a fresh process of the CUDA venv; prints one JSON line.
PROBE = r"""
import json
from fastcredit._ext import cuda_ext_status  # loads fastcredit._C before torch, as a CPU-side caller would
status = cuda_ext_status()
cudart = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line})
import torch
import fastcredit._C
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fastcredit::"))
try:
    torch.ops.fastcredit.merge_topk(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4, dtype=torch.long), 2)
    cpu_error = None
except Exception as exc:
    cpu_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
print(json.dumps({"ext_status": status, "so": fastcredit._C.__file__, "libcudart_mapped": cudart, "ops": ops,
                  "cpu_op_error": cpu_error}))
"""


class StepFailed(Exception):
    def __init__(self, step: str, reason: str):
        super().__init__(f"{step}: {reason}")
        self.step, self.reason = step, reason


def say(msg: str) -> None:
    print(f"[preflight] {msg}", flush=True)


def makefile_gpu_commands(makefile: str) -> tuple[str, str]:
    """The Makefile's GPU-stack build line and import line, as written there (``$(PY)`` not yet substituted)."""
    build = imp = None
    with open(makefile, encoding="utf-8") as f:
        text = f.read()
    # A recipe line may go on over several lines ending in a backslash: make joins them, and so does this.
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        cmd = line.strip()
        if cmd.startswith("FASTCREDIT_BUILD_CUDA=1 $(PY)") and "--no-build-isolation" in cmd:
            build = cmd
        elif cmd.startswith("$(PY) -c") and "import fastcredit._C" in cmd:
            imp = cmd
    if build is None or imp is None:
        raise ValueError(f"{makefile}: no GPU build line (FASTCREDIT_BUILD_CUDA=1 $(PY) ... --no-build-isolation) or "
                         "no import line ($(PY) -c \"import fastcredit._C ...\"); update "
                         "tools/gpu/gpu_preflight_build.py")
    return build, imp


def parse_readelf(text: str) -> dict:
    """RUNPATH, RPATH (lists of folders) and NEEDED (sonames) from ``readelf -d`` output."""
    def paths(tag: str) -> list[str]:
        m = re.search(rf"\({tag}\)\s+Library \w+: \[(.*)\]", text)
        return m.group(1).split(":") if m else []

    return {"runpath": paths("RUNPATH"), "rpath": paths("RPATH"),
            "needed": re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", text)}


class Log:
    """build.log, with each command's output streamed into it and a heartbeat on stdout while it runs."""

    def __init__(self, path: str):
        self.f = open(path, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        self.f.write(text)
        self.f.flush()

    def _drain(self, stream, out: list) -> None:
        for line in stream:
            out.append(line)
            self.write(line)

    def run(self, step: str, cmd, cwd: str, env: dict, timeout: int, shell: bool = False) -> str:
        """Run ``cmd``; its output goes to the log and is returned. Raises StepFailed on non-zero exit or timeout."""
        shown = cmd if isinstance(cmd, str) else shlex.join(cmd)
        self.write(f"\n$ {shown}\n")
        start, out = time.monotonic(), []
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, shell=shell, executable="/bin/bash" if shell else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)  # its own process group: a timeout ends pip and nvcc too
        reader = threading.Thread(target=self._drain, args=(proc.stdout, out), daemon=True)
        reader.start()
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise StepFailed(step, f"timed out after {timeout} s: {shown}") from None
                say(f"  {step}: still running, {elapsed:.0f} s")
        reader.join()
        text = "".join(out)
        if proc.returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-15:])
            raise StepFailed(step, f"exit {proc.returncode}: {shown}\n{tail}")
        return text


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def ensure_venv(venv: str, torch_req: str, log: Log, report: dict) -> None:
    """Create the CUDA venv and install torch plus the build tools, unless its stamp says that was done."""
    wanted = [*PIP_TOOLS, torch_req, *BUILD_TOOLS]
    stamp = os.path.join(venv, STAMP)
    if os.path.exists(stamp) and json.load(open(stamp)).get("requirements") == wanted:
        say(f"venv: reusing {venv} (stamp {STAMP})")
        report["venv_reused"] = True
        report["seconds"].update(venv=0.0, install=0.0)
    else:
        report["venv_reused"] = False
        env = dict(os.environ)
        start = time.monotonic()
        if not os.path.exists(venv_python(venv)):
            say(f"venv: creating {venv}")
            os.makedirs(os.path.dirname(venv), exist_ok=True)
            log.run("venv", [sys.executable, "-m", "venv", venv], ROOT, env, 300)
        report["seconds"]["venv"] = round(time.monotonic() - start, 1)
        say(f"install: {' '.join(wanted)} (several GB, minutes)")
        start = time.monotonic()
        pip = [venv_python(venv), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
        log.run("install", [*pip, "--upgrade", *PIP_TOOLS], ROOT, env, 600)
        log.run("install", [*pip, torch_req, *BUILD_TOOLS], ROOT, env, 3600)
        report["seconds"]["install"] = round(time.monotonic() - start, 1)
        with open(stamp, "w") as f:
            json.dump({"requirements": wanted, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
    out = log.run("venv", [venv_python(venv), "-c", "import sys, torch; print(sys.version.split()[0], "
                           "torch.__version__, torch.version.cuda)"], ROOT, dict(os.environ), 300)
    python, torch_version, torch_cuda = out.split()[-3:]
    report.update(python=python, torch=torch_version, torch_cuda=torch_cuda)
    if torch_cuda == "None":
        raise StepFailed("venv", f"{venv} has a CPU build of torch ({torch_version}); remove it or point "
                                 "FASTCREDIT_CUDA_VENV elsewhere")
    du = subprocess.run(["du", "-sm", venv], capture_output=True, text=True)
    report["venv_disk_mb"] = int(du.stdout.split()[0]) if du.returncode == 0 else None


def copy_tree(dest: str) -> int:
    """Copy the checkout's tracked and untracked-but-not-ignored files (as they are on disk) into ``dest``."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
    copied = 0
    for rel in filter(None, listing.split("\0")):
        src = os.path.join(ROOT, rel)
        if not os.path.lexists(src) or os.path.isdir(src):  # deleted in the work tree, or a submodule
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel), follow_symlinks=False)
        copied += 1
    return copied


def cuda_archs(tree: str) -> str:
    """TORCH_CUDA_ARCH_LIST as setup.py will use it: the environment's, else fastcredit/_build.py's CUDA_ARCHS."""
    spec = importlib.util.spec_from_file_location("_fastcredit_build", os.path.join(tree, "fastcredit", "_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return os.environ.get("TORCH_CUDA_ARCH_LIST", module.CUDA_ARCHS)


def flags_used(build_output: str) -> dict:
    """What the build printed: setup.py's TORCH_CUDA_ARCH_LIST and rpath, and the nvcc lines' -std and -gencode."""
    arch = re.search(r"building fastcredit\._C for TORCH_CUDA_ARCH_LIST=(\S+)", build_output)
    rpath = re.search(r"fastcredit\._C searches (\S+) at load time", build_output)
    nvcc = [ln for ln in build_output.splitlines() if "nvcc" in ln and " -c " in ln]
    return {"torch_cuda_arch_list": arch.group(1) if arch else None, "rpath": rpath.group(1) if rpath else None,
            "nvcc_std": sorted({f for ln in nvcc for f in re.findall(r"-std=\S+", ln)}),
            "nvcc_gencode": sorted({f for ln in nvcc for f in re.findall(r"-gencode=\S+", ln)})}


def build_env(venv: str) -> dict:
    env = dict(os.environ)
    env["CUDA_HOME"] = env.get("CUDA_HOME", "/usr/local/cuda")
    env["PATH"] = os.path.join(env["CUDA_HOME"], "bin") + os.pathsep + env.get("PATH", "")
    # Cancels the build line's -q (verbosity = verbose - quiet): the log then shows setup.py's lines and ninja's
    # compiler lines. The command line stays the Makefile's.
    env["PIP_VERBOSE"] = "2"
    return env


def fresh_env(env: dict) -> dict:
    """The import must stand on the .so's own rpath: nothing on LD_LIBRARY_PATH or PYTHONPATH helps it."""
    return {k: v for k, v in env.items() if k not in ("LD_LIBRARY_PATH", "PYTHONPATH", "LD_PRELOAD")}


def build_and_import(tree: str, venv: str, log: Log, report: dict) -> None:
    try:
        build_cmd, import_cmd = makefile_gpu_commands(os.path.join(tree, "Makefile"))
    except ValueError as exc:
        raise StepFailed("build", str(exc)) from None
    py = shlex.quote(venv_python(venv))
    build_cmd, import_cmd = build_cmd.replace("$(PY)", py), import_cmd.replace("$(PY)", py)
    report["commands"] = {"build": build_cmd, "import": import_cmd}
    env = build_env(venv)
    build(build_cmd, tree, env, log, report)
    say(f"import: {import_cmd}  (fresh process, no LD_LIBRARY_PATH)")
    start = time.monotonic()
    try:
        log.run("import", import_cmd, tree, fresh_env(env), 300, shell=True)
    finally:
        report["seconds"]["import"] = round(time.monotonic() - start, 1)


def build(build_cmd: str, tree: str, env: dict, log: Log, report: dict) -> str:
    """Run the build line; record the toolchain, what the build printed, and the .so's dynamic section."""
    nvcc = subprocess.run([os.path.join(env["CUDA_HOME"], "bin", "nvcc"), "--version"], capture_output=True, text=True)
    release = re.search(r"release (\S+), (V\S+)", nvcc.stdout)
    report["nvcc"] = " ".join(release.groups()) if release else f"no nvcc in {env['CUDA_HOME']}/bin"
    report["cuda_home"] = env["CUDA_HOME"]
    report["torch_cuda_arch_list"] = cuda_archs(tree)
    report["ld_library_path_at_build"] = env.get("LD_LIBRARY_PATH", "")
    say(f"build: {build_cmd}  (TORCH_CUDA_ARCH_LIST={report['torch_cuda_arch_list']}; minutes)")
    report["build_env"] = {k: env[k] for k in ("CUDA_HOME", "PIP_VERBOSE")}
    start = time.monotonic()
    try:
        output = log.run("build", build_cmd, tree, env, 3600, shell=True)
    finally:
        report["seconds"]["build"] = round(time.monotonic() - start, 1)
    report["build_printed"] = flags_used(output)
    so = sorted(f for f in os.listdir(os.path.join(tree, "fastcredit")) if f.startswith("_C") and f.endswith(".so"))
    if not so:
        raise StepFailed("build", "the build passed but wrote no fastcredit/_C*.so")
    so_path = os.path.join(tree, "fastcredit", so[0])
    report["so"] = {"name": so[0], "bytes": os.path.getsize(so_path)}
    elf = subprocess.run(["readelf", "-d", so_path], capture_output=True, text=True)
    log.write(f"\n$ readelf -d {so_path}\n{elf.stdout}{elf.stderr}")
    report["so"].update(parse_readelf(elf.stdout))
    return so_path


def inspect_ops(tree: str, venv: str, log: Log, report: dict) -> None:
    say("inspect: libcudart copies mapped, ops registered, an op on CPU tensors")
    out = log.run("inspect", [venv_python(venv), "-c", PROBE], tree, fresh_env(build_env(venv)), 300)
    probe = json.loads(out.strip().splitlines()[-1])
    report["probe"] = probe
    if probe["ext_status"] != "loaded":
        raise StepFailed("inspect", f"fastcredit._ext could not load the extension: {probe['ext_status']}")
    if not os.path.realpath(probe["so"]).startswith(os.path.realpath(tree)):
        raise StepFailed("inspect", f"imported {probe['so']}, not the scratch tree's build")
    if len(probe["libcudart_mapped"]) != 1:
        raise StepFailed("inspect", f"expected one libcudart in the process, got {probe['libcudart_mapped']}")
    searched = {os.path.realpath(d) for d in report["so"]["rpath"] + report["so"]["runpath"]}
    if os.path.realpath(os.path.dirname(probe["libcudart_mapped"][0])) not in searched:
        raise StepFailed("inspect", f"libcudart came from {probe['libcudart_mapped'][0]}, not a folder of the .so's "
                                    f"rpath {sorted(searched)}: the loader found another copy")
    if not probe["ops"]:
        raise StepFailed("inspect", "no op registered under torch.ops.fastcredit")
    if probe["cpu_op_error"] is None:
        raise StepFailed("inspect", "merge_topk accepted CPU tensors; it must refuse them")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = os.path.abspath(argv[0])
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "build.log"))
    venv = os.path.abspath(os.environ.get("FASTCREDIT_CUDA_VENV", DEFAULT_VENV))
    report = {"status": "failed", "venv": venv, "seconds": {}}
    tree = tempfile.mkdtemp(prefix="fastcredit-preflight-")
    total = time.monotonic()
    try:
        ensure_venv(venv, os.environ.get("FASTCREDIT_CUDA_TORCH", DEFAULT_TORCH), log, report)
        start = time.monotonic()
        report["files_copied"] = copy_tree(tree)
        report["seconds"]["copy"] = round(time.monotonic() - start, 1)
        say(f"copy: {report['files_copied']} files into {tree}")
        build_and_import(tree, venv, log, report)
        inspect_ops(tree, venv, log, report)
        report["status"] = "passed"
    except StepFailed as exc:
        report.update(failed_step=exc.step, reason=exc.reason)
    except Exception as exc:  # a bug here, or an unexpected tool output: still write build.json
        report.update(failed_step="script", reason=f"{type(exc).__name__}: {exc}")
        log.write(traceback.format_exc())
    finally:
        report["seconds"]["total"] = round(time.monotonic() - total, 1)
        if report["status"] == "passed":
            shutil.rmtree(tree, ignore_errors=True)
        else:
            report["scratch_tree"] = tree
        with open(os.path.join(out, "build.json"), "w") as f:
            json.dump(report, f, indent=1)
        log.f.close()
    say(f"{report['status']} in {report['seconds']['total']} s; {os.path.join(out, 'build.json')}")
    if report["status"] != "passed":
        say(f"failed at {report['failed_step']}: {report['reason']}")
    return 0 if report["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
