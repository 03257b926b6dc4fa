"""Launch N cooperating JAX processes on this machine: multi-host behaviour without a cluster.

    python -m distillax.launch_local -n 2 --devices_per_process 4 -- \\
        distillax train --config distillax/configs/lm.py:tiny --workdir runs/mp

Each child gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (read by
`distillax.framework.run.runtime.initialize`) and its own simulated CPU devices. If any child fails
or the timeout passes, every child is killed by PID, so nothing is left hanging.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, *, address: str, num: int, pid: int, devices: int) -> dict:
  env = dict(base)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(num),
             JAX_PROCESS_ID=str(pid))
  return env


def launch(command: list[str], num_processes: int, devices_per_process: int = 4,
           timeout_s: float = 600, env: dict | None = None, log_dir: str | None = None) -> int:
  """Runs `command` N times as one JAX job; returns the first non-zero exit status, else 0."""
  address = f"127.0.0.1:{free_port()}"
  procs, logs = [], []
  for pid in range(num_processes):
    out = None
    if log_dir:
      os.makedirs(log_dir, exist_ok=True)
      out = open(os.path.join(log_dir, f"process_{pid}.log"), "w")
      logs.append(out)
    procs.append(subprocess.Popen(
        command, env=child_env(env or os.environ, address=address, num=num_processes, pid=pid,
                               devices=devices_per_process),
        stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True))
  deadline = time.monotonic() + timeout_s
  status = 0
  try:
    while procs and any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed or time.monotonic() > deadline:
        status = failed[0] if failed else 124
        break
      time.sleep(0.1)
    else:
      status = next((p.returncode for p in procs if p.returncode), 0)
  finally:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()
    for f in logs:
      f.close()
  if status == 124:
    print(f"launch_local: timed out after {timeout_s:.0f}s; killed all processes",
          file=sys.stderr)
  return status


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("-n", "--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=4)
  parser.add_argument("--timeout_s", type=float, default=3600)
  parser.add_argument("--log_dir", default=None, help="one log file per process (else inherit)")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command to run after --")
  return launch(command, args.num_processes, args.devices_per_process, args.timeout_s,
                log_dir=args.log_dir)


if __name__ == "__main__":
  sys.exit(main())
