"""Multi-controller runtime: `jax.distributed` set-up and the per-process view of a run.

One process needs nothing. Several processes (hosts of a pod, or local processes in tests) each
run the same program; `initialize` joins them into one JAX runtime, after which `jax.devices()`
is the global device list and a mesh spans every host. Each process loads its own slice of the
data; `backends` turns those process-local batches into global arrays.

Starting JAX's backends (opening a TPU: 7.2 s on the lent v5e) used to wait for the job's
imports (flax, orbax, grain, ...: 7.1 s there). The CLI starts them in a thread instead
(`open_devices_early`), when the command line and environment launch no distributed runtime
(distillax/cli/devices.py), so the two overlap; the recipe waits for that thread
(`wait_for_early_devices`) where it used to start them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import jax

from distillax.errors import ConfigError

_ENV_HINTS = ("COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
# The environment that launches a process as one of several (cli/devices.py reads it too).
DISTRIBUTED_ENV = _ENV_HINTS + ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _get(cfg: Any, key: str, default=None):
  if cfg is None:
    return default
  return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def initialize(config: Any = None, *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               local_device_ids=None, timeout_s: int = 300) -> bool:
  """Joins the distributed runtime when asked; a no-op for a single process.

  Explicit arguments (CLI flags) win over `config.runtime.*`, which win over the environment
  (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`). With
  `config.runtime.auto_detect=True` and nothing else given, JAX's own cluster detection runs
  (TPU pods, SLURM, Open MPI). Returns True when the runtime was initialised here.
  """
  rt = _get(config, "runtime")
  address = coordinator_address or _get(rt, "coordinator_address") or next(
      (os.environ[k] for k in _ENV_HINTS if os.environ.get(k)), None)
  num = num_processes or _get(rt, "num_processes") or _env_int("JAX_NUM_PROCESSES")
  pid = process_id if process_id is not None else _get(rt, "process_id")
  if pid is None or pid < 0:
    pid = _env_int("JAX_PROCESS_ID")
  auto = bool(_get(rt, "auto_detect", False))
  if jax.distributed.is_initialized():
    return False
  if _early is not None and (address or auto):
    raise ConfigError(
        "the config file sets config.runtime (coordinator_address or auto_detect), but `train` "
        "opens the devices while its modules import, before it reads the config file, and JAX's "
        "distributed runtime must start first; give it on the command line instead: "
        "--config.runtime.auto_detect=True, or --coordinator_address=HOST:PORT "
        "--num_processes=N --process_id=I")
  if not address and not auto:
    if num and num > 1:
      raise ConfigError(f"num_processes={num} but no coordinator address; pass "
                        f"--coordinator_address=HOST:PORT (the same on every process)")
    return False
  if address and (num is None or pid is None):
    raise ConfigError("a coordinator address needs --num_processes and --process_id too "
                      "(or JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
  kwargs = dict(initialization_timeout=timeout_s)
  if local_device_ids is not None:
    kwargs["local_device_ids"] = local_device_ids
  if address:
    jax.distributed.initialize(address, num_processes=int(num), process_id=int(pid), **kwargs)
  else:
    jax.distributed.initialize(**kwargs)
  logging.info("process %d of %d joined: %d local devices, %d global", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def _env_int(name: str) -> int | None:
  v = os.environ.get(name)
  return int(v) if v not in (None, "") else None


def is_primary() -> bool:
  """Only process 0 writes logs, metrics and summaries; every process joins checkpoints."""
  return jax.process_index() == 0


def primary_says(ok: bool) -> bool:
  """Process 0's `ok`, on every process (a broadcast: every process must call it); `ok` itself
  for a single process. What one process decides for the job (the workdir's lock, say) then
  ends every process alike, not the others later in a collective's timeout."""
  if jax.process_count() == 1:
    return ok
  import numpy as np
  from jax.experimental import multihost_utils
  return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


@dataclasses.dataclass
class _EarlyDevices:
  thread: threading.Thread
  seconds: float | None = None  # how long jax.devices() took in the thread
  error: BaseException | None = None


_early: _EarlyDevices | None = None


def open_devices_early() -> None:
  """Starts JAX's backends (`jax.devices()`) in a daemon thread, while the caller goes on
  importing the job's modules. Only for a process that joins no distributed runtime (a backend
  started before `jax.distributed.initialize` breaks it; `initialize` refuses to join one after
  this), and only once the platforms and XLA_FLAGS are set (main.py: --devices, JAX_PLATFORMS),
  which the backends read when they start. The thread's error is raised by
  `wait_for_early_devices`, in the caller's thread."""
  global _early
  if _early is not None:
    return
  early = _EarlyDevices(threading.Thread(target=lambda: _open(early), daemon=True,
                                         name="distillax-devices"))
  _early = early
  early.thread.start()


def _open(early: _EarlyDevices) -> None:
  start = time.perf_counter()
  try:
    jax.devices()
  except BaseException as e:  # noqa: BLE001 - raised again where the caller waits
    early.error = e
  early.seconds = time.perf_counter() - start


def wait_for_early_devices() -> float | None:
  """Seconds the early start of the devices took (waiting for it if it is still going), or
  None when nothing started them early; its error, if it failed, is raised here (once: later
  calls, and JAX's own, start the backends as usual)."""
  global _early
  early, _early = _early, None
  if early is None:
    return None
  early.thread.join()
  if early.error is not None:
    raise early.error
  return early.seconds


def settle_early_devices() -> None:
  """Waits for an early start of the devices that nothing waited for (a command that failed
  before its job opened them), so the interpreter never exits while a backend is starting."""
  global _early
  early, _early = _early, None
  if early is not None:
    early.thread.join()
