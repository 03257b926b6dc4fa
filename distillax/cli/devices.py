"""`--devices N`: simulated CPU devices, set in XLA_FLAGS before anything imports JAX (XLA reads
the flags once, when JAX creates its CPU backend). Standard library only, so importing this (and
distillax.main) never starts JAX."""

from __future__ import annotations

import os

from distillax.cli.flags import flag_value

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
