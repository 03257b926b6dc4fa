"""`--devices N`: simulated CPU devices, set in XLA_FLAGS before anything imports JAX (XLA reads
the flags once, when JAX creates its CPU backend). Standard library only, so importing this (and
distillax.main) never starts JAX.

Also when the devices open: `train` starts JAX's backends in a thread as soon as JAX is imported
(and the platforms and XLA_FLAGS are set), so that they open while the job's modules import
(framework/run/runtime.py). On the lent TPU v5e the chip took 7.2 s to open after 7.1 s of
imports, one after the other: a third of the 42 s to distill_qwen3.py's first step. The config
file cannot be read before those imports (config files import the data, optimizer and model
modules), so the command line and the environment decide: a launch of several processes, which
must join JAX's distributed runtime before any backend starts, says so there (--num_processes,
--coordinator_address, --process_id, --config.runtime.*, JAX_COORDINATOR_ADDRESS, ...: every
launcher in scripts/ and docs/guides/launching.md) and opens its devices when the job does. A
config file that asks for the distributed runtime itself is refused with the command-line form
(runtime.initialize).
"""

from __future__ import annotations

import os
import sys

from distillax.cli.flags import DISTRIBUTED_FLAGS, flag_value

# XLA:CPU's collective deadlines for simulated devices (its own: 20 s warn, 40 s terminate).
_PATIENT_COLLECTIVES = {"--xla_cpu_collective_call_warn_stuck_timeout_seconds": 60,
                        "--xla_cpu_collective_call_terminate_timeout_seconds": 540}
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def preset_devices(argv: list[str]) -> str | None:
  """`--devices N` simulates N CPU devices (plan; train on a CPU host, as the demo does); XLA
  reads this before JAX is imported, so it is handled before anything imports JAX. Returns the
  error line for a value that is not a positive whole number.

  Simulated devices (from --devices, or a device count already in XLA_FLAGS, as launch_local
  and tests/conftest.py set it) also get patient collectives: XLA:CPU runs each device's share
  of a collective on its own thread and aborts the process (rc 134, "Termination timeout ...
  only 7 of them arrived") when one thread arrives 20 s + 40 s after the first, which 8 devices
  on 2 busy cores can reach with nothing wrong. Here the limit is 60 s + 540 s; XLA_FLAGS that
  set either flag keep their own value."""
  value = flag_value(argv, "devices")
  if value is not None:
    if not (value.isdigit() and int(value) > 0):
      return (f"--devices={value} must be a positive whole number of simulated CPU devices, "
              f"e.g. --devices 8")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT}={value}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "").split()
  if any(f.startswith(_DEVICE_COUNT) for f in flags):
    given = {f.split("=", 1)[0] for f in flags}
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"{name}={s}" for name, s in _PATIENT_COLLECTIVES.items() if name not in given])
  return None


# The commands whose job opens this host's devices as it starts (its recipe does).
OPENS_DEVICES_EARLY = ("train",)


def opens_devices_early(command: str, argv: list[str]) -> bool:
  """Whether `command` starts JAX's backends before the job's imports: it opens devices, and
  nothing on the command line (`argv`, after the command) or in the environment asks for the
  distributed runtime, which has to start first."""
  if command not in OPENS_DEVICES_EARLY:
    return False
  if any(flag_value(argv, name) is not None for name in DISTRIBUTED_FLAGS):
    return False
  if any(a.startswith("--config.runtime.") for a in argv):
    return False
  from distillax.framework.run.runtime import DISTRIBUTED_ENV  # JAX: XLA_FLAGS are set by now
  return not any(os.environ.get(name) for name in DISTRIBUTED_ENV)


def settle_early_devices() -> None:
  """Returns once no backend is starting in the early thread (a command that failed before its
  job waited for it): the interpreter's teardown, JAX's included, must not run beside it."""
  runtime = sys.modules.get("distillax.framework.run.runtime")
  if runtime is not None:
    runtime.settle_early_devices()
