"""Simulated device counts without importing JAX: one child process per count.

XLA reads `--xla_force_host_platform_device_count` once, when JAX initialises its CPU backend,
so a script that measures 1, 2, 4, 8 and 64 devices re-invokes itself once per count with
`--devices N --child-out FILE`; the child sets the flag before importing JAX, does its part and
writes JSON to FILE; the parent collects it. Nothing here imports JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
  """Makes JAX's CPU backend expose `n` devices; must run before JAX is imported."""
  if "jax" in sys.modules:
    raise RuntimeError("force_host_devices must run before jax is imported")
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_FLAG}={int(n)}"])


def ensure_repo_on_path() -> None:
  """`python benchmarks/x.py` from a fresh clone: make `distillax` and `benchmarks` importable."""
  if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def run_child(script: Path, devices: int, args: Sequence[str], *, echo: bool = True) -> dict:
  """Runs `script --devices N --child-out F *args` and returns the JSON it wrote to F."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "child.json"
    cmd = [sys.executable, str(script), "--devices", str(devices), "--child-out", str(out),
           *args]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    start = time.perf_counter()
    tail: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
      for line in proc.stdout:  # stream the child's progress, keep its tail for errors
        if echo:
          print(f"  [{devices} dev] {line}", end="", flush=True)
        tail = (tail + [line.rstrip()])[-40:]
      proc.wait()
    if proc.returncode != 0 or not out.exists():
      raise RuntimeError(f"child {' '.join(cmd)} failed (exit {proc.returncode}):\n" +
                         "\n".join(tail))
    result = json.loads(out.read_text())
    result.setdefault("child_seconds", time.perf_counter() - start)
    return result


def base_parser(description: str, default_devices: int) -> argparse.ArgumentParser:
  """Flags every benchmark script shares: --quick, --out, and the child-process plumbing."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true",
                      help="smallest settings (seconds; what the smoke tests run)")
  parser.add_argument("--out", default=str(RESULTS_DIR),
                      help="folder for the JSON (and PNG) results")
  parser.add_argument("--devices", type=int, default=default_devices,
                      help="simulated CPU devices of this process (set before JAX starts)")
  parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
  return parser


def parse_args_before_jax(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
  """Parses the flags and sets the device count; call before importing JAX."""
  args = parser.parse_args(argv)
  ensure_repo_on_path()
  force_host_devices(args.devices)  # only the CPU backend reads it; harmless on accelerators
  return args


def write_child_result(path: str, payload: dict) -> None:
  Path(path).write_text(json.dumps(payload))
