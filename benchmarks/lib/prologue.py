"""The one device prologue of every benchmark script: simulated CPU devices, before JAX starts.

XLA reads `--xla_force_host_platform_device_count` once, when JAX creates its CPU backend, so
the count must be in XLA_FLAGS before anything imports JAX. A script therefore starts with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    from benchmarks.lib import prologue
    prologue.start(__name__, default_devices=8)
    import jax  # and distillax, the library, ... at the top of the file

`start` reads `--devices N` from the command line (the flag `subproc.base_parser` declares, so
`--help` documents it) or takes the script's default, and writes it into XLA_FLAGS; every other
XLA flag of the environment is kept. Only the CPU backend reads the count: on a GPU or TPU it
changes nothing. Standard library only: importing this module never starts JAX.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

BENCHMARKS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCHMARKS_DIR.parent
DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class Devices:
  default: int  # the script's own default (what --help shows)
  count: int  # what XLA_FLAGS asks JAX's CPU backend for


_started: Devices | None = None


def devices_in(argv: Sequence[str]) -> int | None:
  """The last `--devices N` / `--devices=N` of argv if N is a positive whole number, else None
  (argparse then rejects a bad value in one line; abbreviations are off in base_parser)."""
  found = None
  for i, arg in enumerate(argv):
    if arg == "--devices" and i + 1 < len(argv):
      found = argv[i + 1]
    elif arg.startswith("--devices="):
      found = arg.partition("=")[2]
  return int(found) if found is not None and found.isdigit() and int(found) > 0 else None


def force_host_devices(n: int) -> None:
  """Makes JAX's CPU backend expose `n` devices; must run before JAX is imported."""
  if "jax" in sys.modules:
    raise RuntimeError("force_host_devices must run before jax is imported")
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_FLAG}={int(n)}"])


def start(module_name: str, default_devices: int, argv: Sequence[str] | None = None) -> None:
  """Sets the device count when `module_name` is "__main__" (the script runs, or is one of its
  own child processes); a test that imports the script for its helpers keeps its own devices.
  A script run as "__main__" inside a process whose JAX already started (a test running it with
  runpy, to share that process's imports and compiles) accepts that JAX if its device count is
  the one asked for, and otherwise stops in one line with exit status 2.

  It also takes benchmarks/ and benchmarks/lib/ off sys.path: Python puts a script's folder
  first, and the scripts are named after what they measure (peft.py, qat.py, edge.py, common.py),
  which would shadow installed packages of those names (transformers looks for `peft`)."""
  global _started
  if module_name != "__main__":
    return
  folders = (BENCHMARKS_DIR, BENCHMARKS_DIR / "lib")
  sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in folders]
  if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
  count = devices_in(sys.argv[1:] if argv is None else argv) or default_devices
  if "jax" in sys.modules:  # run inside a process whose JAX already started (a test's)
    _accept_running_jax(count)
  else:
    force_host_devices(count)
  _started = Devices(default_devices, count)


def _accept_running_jax(count: int) -> None:
  """A JAX that already runs keeps its devices: the script runs on it if it has `count` devices,
  and otherwise stops in one line (exit 2) instead of measuring on other devices than asked."""
  running = sys.modules["jax"].device_count()
  if running != count:
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "benchmark"
    sys.stderr.write(f"{script}: error: JAX already runs with {running} devices, "
                     f"this run asks for --devices {count}: run the script in its own process\n")
    raise SystemExit(2)


def started() -> Devices:
  """The devices `start` set in this process."""
  if _started is None:
    raise RuntimeError("benchmarks.lib.prologue.start(__name__, ...) has not run in this script")
  return _started
