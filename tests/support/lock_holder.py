"""A real process that holds a workdir's lock (distillax/framework/run/workdir_lock.py) until
told to let go, for the tests of one job per workdir.

`with holding(workdir) as holder:` starts it and returns once it holds the lock (it says so on
its stdout: no sleep, no timing); leaving the block closes its stdin and it releases and exits.
`holder.kill()` ends it by SIGKILL, as a crash would, leaving its lock.json behind.
`holding(workdir, fork_child=True)`: the holder forks a child that inherits the locked file and
then exits itself, as a crashed trainer's data worker would keep it; `holder.child` is its pid.
The holder loads the lock module by its path, so it starts without importing JAX.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MODULE = os.path.join(ROOT, "distillax", "framework", "run", "workdir_lock.py")

_SCRIPT = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("workdir_lock", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
lock = module.WorkdirLock(sys.argv[2])
lock.acquire(lambda workdir, e: e)
if sys.argv[3] == "fork":
  child = os.fork()
  if child == 0:  # keeps the inherited locked file open until its stdin closes
    sys.stdin.read()
    os._exit(0)
  print(child, flush=True)
  os._exit(0)  # the holder dies without releasing; its child still holds the flock
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


class Holder:
  def __init__(self, proc: subprocess.Popen, child: int | None):
    self.proc, self.child, self.pid = proc, child, proc.pid

  def kill(self) -> None:
    self.proc.kill()
    self.proc.wait()  # reaped: a zombie would still answer kill(pid, 0)


@contextlib.contextmanager
def holding(workdir, *, fork_child: bool = False):
  proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, _MODULE, str(workdir),
                           "fork" if fork_child else "hold"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  try:
    line = proc.stdout.readline().strip()
    child = None
    if fork_child:
      child = int(line)
      proc.wait()
    else:
      assert line == "held", line
    yield Holder(proc, child)
  finally:
    if proc.stdin and not proc.stdin.closed:
      proc.stdin.close()
    proc.wait()
    if child is not None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
