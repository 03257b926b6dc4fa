"""XLA:CPU's default code generators for the few tests whose claim is about the very program a
user's JAX compiles. tests/conftest.py compiles the suite with XLA:CPU's older elemental kernel
emitters (they compile faster); those expand a scatter into a while loop of its own (a loop
whose trip count the HLO reader cannot see from the loop's call site) and order some sums
differently (last-bit noise a gradient-equality tolerance of 1e-6 can catch). And the other way
round: the suite's cheap compile kept for a child process that sizes its own devices."""

import os

DEFAULT_CPU_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
# XLA:CPU's own defaults for everything tests/conftest.py makes cheaper: the program a user's
# JAX builds, at its full compile cost and run speed.
DEFAULT_CPU_COMPILE = {**DEFAULT_CPU_EMITTERS, "xla_backend_optimization_level": 3,
                       "xla_llvm_disable_expensive_passes": False,
                       "xla_cpu_parallel_codegen_split_count": 32}


class _WithOptions:
  """A lowered program whose compile() passes `options` to XLA."""

  def __init__(self, lowered, options):
    self.lowered, self.options = lowered, options

  def compile(self):
    return self.lowered.compile(compiler_options=self.options)


def compile_steps_with(monkeypatch, options) -> None:
  """Every train step compiled ahead of time from here on (framework/backends.py) is compiled
  with these XLA options, whatever the suite's XLA_FLAGS say."""
  from distillax.framework import backends, step_program

  def compiled(fn, abstract_state, abstract_batch, compile_now, backend):
    if not compile_now:
      return fn
    lowered = _WithOptions(fn.lower(abstract_state, abstract_batch), options)
    return step_program.AotStep(lowered, background=compile_now == "background")

  monkeypatch.setattr(backends, "_compiled", compiled)


def compile_steps_with_default_cpu_emitters(monkeypatch) -> None:
  """Every train step compiled ahead of time from here on gets XLA:CPU's default emitters."""
  compile_steps_with(monkeypatch, DEFAULT_CPU_EMITTERS)


def compile_steps_fully_optimized(monkeypatch) -> None:
  """Every train step compiled ahead of time from here on is compiled as a user's XLA:CPU
  compiles it (DEFAULT_CPU_COMPILE): for the few tests that run one step program hundreds of
  times, where the cheap compile's slower code costs more than the full compile. Measured on
  tests/quant/test_recovery.py (1,300 steps of three programs): 38 s -> 19 s."""
  compile_steps_with(monkeypatch, DEFAULT_CPU_COMPILE)


SIMULATED_DEVICES = "--xla_force_host_platform_device_count"


def env_for_a_child_that_sizes_its_devices(**extra: str) -> dict:
  """This session's environment for a child process that sets its own device count (`--devices`):
  tests/conftest.py's XLA_FLAGS less the suite's 8 simulated devices. Dropping XLA_FLAGS whole
  also dropped the suite's cheap XLA:CPU compile, and the child compiled with XLA's full
  optimisation: `plan` of Llama 3.1 8B on 64 devices took 16.3 s instead of 5.8 s, its printed
  plan the same to the byte but for its compile time."""
  env = dict(os.environ, **extra)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=")[0] != SIMULATED_DEVICES]
  env["XLA_FLAGS"] = " ".join(flags)
  return env
