"""How distillax logs: its own lines at INFO, other libraries' (orbax, jax, grain, absl) only from
WARNING unless `--verbose`, one short format, and a `[process i/n]` prefix on every line when
several processes run (their lines interleave on one console or in one SLURM log).

absl, orbax, jax and grain all log through Python's `logging` (absl's `logging.info` goes to the
'absl' logger), so one handler on the root logger formats and filters every line. absl's own
handler is kept off the root logger: it prints "WARNING: Logging before flag parsing goes to
stderr." whenever absl's global flags were never parsed, which is always the case here (the CLI
parses flags of its own).

    logs.configure(verbose=False)   # at start-up, before anything logs; again once flags parsed

The process prefix needs no call: the first line formatted after `jax.distributed` is up fixes
it (asking JAX for the process index before then would start its backends too early and break
the distributed set-up, so lines before it carry none: a single process as far as anyone knows).
"""

from __future__ import annotations

import logging
import os
import sys
import time

# distillax/: a record made by code in here (absl's logging.info included) is distillax's own.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def is_own(record: logging.LogRecord) -> bool:
  """True for lines logged by distillax itself, through `logging` or absl's logging."""
  if record.name == "distillax" or record.name.startswith("distillax."):
    return True
  return os.path.abspath(record.pathname).startswith(PACKAGE_DIR + os.sep)


def process_prefix() -> str:
  """`[process i/n] ` once the distributed runtime joined several processes, else ''."""
  global _prefix, _asking
  if _prefix is None:
    jax = sys.modules.get("jax")  # a process that never imported JAX has one process
    if _asking or jax is None or not jax.distributed.is_initialized():
      return ""  # _asking: JAX logged while starting its backends for the question below
    _asking = True
    try:
      count = jax.process_count()
      _prefix = f"[process {jax.process_index()}/{count}] " if count > 1 else ""
    finally:
      _asking = False
  return _prefix


_prefix: str | None = None
_asking = False


class _Format(logging.Formatter):
  """`I1201 21:13:04.977 checkpoint.py:198] message`, after `[process i/n] ` when several."""

  def format(self, record: logging.LogRecord) -> str:
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
    text = record.getMessage()
    if record.exc_info:
      text += "\n" + self.formatException(record.exc_info)
    head = (f"{process_prefix()}{record.levelname[:1]}{stamp}.{int(record.msecs):03d} "
            f"{record.filename}:{record.lineno}] ")
    return "\n".join(head + line for line in text.splitlines() or [""])


class _Filter(logging.Filter):
  """distillax's lines from INFO, everyone else's from WARNING; all of them when verbose."""

  def __init__(self, verbose: bool):
    super().__init__()
    self.verbose = verbose

  def filter(self, record: logging.LogRecord) -> bool:
    return self.verbose or record.levelno >= logging.WARNING or is_own(record)


class _StderrHandler(logging.StreamHandler):
  """Writes to whatever sys.stderr is when a line is emitted (a test's captured stderr, too)."""

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, _):
    pass


_FORMAT = _Format()


def _replaced(handler: logging.Handler) -> bool:
  """Console handlers this module's handler stands in for: an earlier one of ours, absl's, and
  the bare one `logging.basicConfig()` adds (absl calls it when a library logs at import time,
  as orbax does; every line would then be printed twice)."""
  from absl import logging as absl_logging
  if isinstance(handler, _StderrHandler) or handler is absl_logging.get_absl_handler():
    return True
  basic = handler.formatter is not None and handler.formatter._fmt == logging.BASIC_FORMAT
  return type(handler) is logging.StreamHandler and (
      basic or handler.stream in (sys.stderr, sys.__stderr__))


def configure(*, verbose: bool = False) -> None:
  """Installs the one handler on the root logger, in place of the console handlers before it."""
  from absl import logging as absl_logging
  root = logging.getLogger()
  for handler in list(root.handlers):
    if _replaced(handler):
      root.removeHandler(handler)
  handler = _StderrHandler()
  handler.setFormatter(_FORMAT)
  handler.addFilter(_Filter(verbose))
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  absl_logging.set_verbosity(absl_logging.INFO)

