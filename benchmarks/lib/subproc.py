"""Simulated device counts without importing JAX: one child process per count, and the flags
every benchmark script shares.

XLA reads the device count once, when JAX initialises its CPU backend, so a script that measures
1, 2, 4, 8 and 64 devices re-invokes itself once per count with `--devices N --child-out FILE`;
the child's prologue (prologue.start) sets the count before it imports JAX, the child does its
part and writes JSON to FILE; the parent collects it. Nothing here imports JAX.
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

from benchmarks.lib import prologue

RESULTS_DIR = prologue.BENCHMARKS_DIR / "results"


def run_child(script: Path, devices: int, args: Sequence[str], *, echo: bool = True) -> dict:
  """Runs `script --devices N --child-out F *args` and returns the JSON it wrote to F."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "child.json"
    cmd = [sys.executable, str(script), "--devices", str(devices), "--child-out", str(out),
           *args]
    env = dict(os.environ)  # the child's prologue replaces the device count, keeps other flags
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


def positive_int(text: str) -> int:
  if not (text.isdigit() and int(text) > 0):
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
  return int(text)


def base_parser(description: str) -> argparse.ArgumentParser:
  """Flags every benchmark script shares: --quick, --out, --devices (read by the prologue before
  JAX starts; declared here so that --help shows it and a bad value fails in one line) and the
  child-process plumbing. No abbreviations: the prologue reads `--devices` as spelled."""
  parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
  parser.add_argument("--quick", action="store_true",
                      help="smallest settings (seconds; what the smoke tests run)")
  parser.add_argument("--out", default=str(RESULTS_DIR),
                      help="folder for the JSON (and PNG) results")
  parser.add_argument("--devices", type=positive_int, default=prologue.started().default,
                      help="simulated CPU devices of this process (set before JAX starts)")
  parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
  return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None):
  """Parses the flags; the device count they name is the one the prologue already set."""
  args = parser.parse_args(argv)
  if args.devices != prologue.started().count:
    parser.error(f"--devices {args.devices}: the prologue set {prologue.started().count} "
                 f"devices before JAX started (spell the flag --devices N)")
  return args


def write_child_result(path: str, payload: dict) -> None:
  Path(path).write_text(json.dumps(payload))
