"""A command for tests/test_forkserver.py that starts python commands of its own through ``subprocess`` (forked
from its zygote where tests/zygote.py can): as a child, it reports itself; as the parent, what it saw of each."""
import json
import os
import subprocess
import sys
import time

if len(sys.argv) > 1 and sys.argv[1] == "child":
    mode = sys.argv[2]
    print(json.dumps({"pid": os.getpid(), "warm": "transformers" in sys.modules, "cwd": os.getcwd(),
                      "env": os.environ.get("ZYGOTE_TEST"), "session": os.getsid(0) == os.getpid(),
                      "stdin": sys.stdin.read() if mode == "echo" else None}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "exit5":
        sys.exit(5)
    if mode == "sleep":
        time.sleep(600)
    sys.exit(0)

out = sys.argv[1]
me = os.path.abspath(__file__)
report = {"popen_class": subprocess.Popen.__name__}
# pipes for all three streams, another folder and environment
done = subprocess.run([sys.executable, me, "child", "echo"], input="hello", capture_output=True, text=True,
                      cwd=out, env={**os.environ, "ZYGOTE_TEST": "1"}, timeout=120)
report["echo"] = {"rc": done.returncode, "child": json.loads(done.stdout), "stderr": done.stderr}
# an exit status, stdout to a file, stderr joined to it
with open(os.path.join(out, "log.txt"), "w") as log:
    proc = subprocess.Popen([sys.executable, me, "child", "exit5"], stdout=log, stderr=subprocess.STDOUT)
    report["exit5"] = {"rc": proc.wait(timeout=120)}
report["exit5"]["log"] = open(os.path.join(out, "log.txt")).read()
# a session of its own, still running at poll, then ended with SIGTERM
proc = subprocess.Popen([sys.executable, me, "child", "sleep"], stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
child = json.loads(proc.stdout.readline())
report["sleep"] = {"child": child, "poll": proc.poll(), "pid_matches": child["pid"] == proc.pid}
proc.terminate()
report["sleep"]["rc"] = proc.wait(timeout=60)
proc.stdout.close()
# what tests/zygote.py leaves to Popen: -c
done = subprocess.run([sys.executable, "-c", "import sys; print('transformers' in sys.modules)"],
                      capture_output=True, text=True, timeout=120)
report["dash_c_warm"] = done.stdout.strip()
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f)
