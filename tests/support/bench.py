"""What the benchmark smoke tests share: the environment their scripts run under and parameter
counts written out by hand from a model's fields (a config, or the JSON summary of one), which
the scripts' figures are checked against."""

from __future__ import annotations

import contextlib
import io
import math
import os
import runpy
import sys
from collections.abc import Mapping

# The smoke tests check figures, not speed: LLVM's optimisation level changes neither XLA's
# buffer assignment nor the values compared, and at 0 the compiles take half the time. The
# scripts also get the rest of the suite's cheap XLA:CPU compile, as tests/conftest.py set it
# in XLA_FLAGS before this is imported (LLVM's expensive passes off; on jaxlib 0.10 the
# elemental kernel emitters): attention_memory.py --quick compiled in 8.9 s of CPU instead of
# 20.9 s; and where jaxlib knows it, one codegen part per program instead of 32 (on 2 cores
# their split only adds work: accelerator.py --quick compiled its eleven programs in 33-39 s
# instead of 49-52 s). Not the simulated device count: each script sizes its own devices.
_CHEAP_COMPILE = ("--xla_llvm_disable_expensive_passes", "--xla_cpu_use_fusion_emitters",
                  "--xla_cpu_parallel_codegen_split_count")
FAST_COMPILE = {"XLA_FLAGS": " ".join(
    ["--xla_backend_optimization_level=0"]
    + [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] in _CHEAP_COMPILE])}


def _fields(m):
  return m if isinstance(m, Mapping) else m.__dict__


def matmul_weights(m) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """One decoder block's matmul weights as (contracted dims, output dims)."""
  m = _fields(m)
  d, h, k, hd, f = (m["embed_dim"], m["num_heads"], m["num_kv_heads"], m["head_dim"],
                    m["mlp_dim"])
  return {"q": ((d,), (h, hd)), "k": ((d,), (k, hd)), "v": ((d,), (k, hd)),
          "o": ((h, hd), (d,)), "gate": ((d,), (f,)), "up": ((d,), (f,)), "down": ((f,), (d,))}


def _block_matmul_params(m) -> int:
  return sum(math.prod(c) * math.prod(o) for c, o in matmul_weights(m).values())


def matmul_params(m, layers: int | None = None) -> int:
  """Weights that take part in a matmul: every block's q, k, v, o, gated MLP, and the output
  layer."""
  f = _fields(m)
  return (layers or f["num_layers"]) * _block_matmul_params(m) + f["vocab_size"] * f["embed_dim"]


def total_params(m, layers: int | None = None) -> int:
  """Every parameter: blocks (matmuls and two norm scales), the embedding, an untied output
  layer, the final norm; `layers` blocks instead of the model's own count when given."""
  f = _fields(m)
  block = _block_matmul_params(m) + 2 * f["embed_dim"]
  embed = f["vocab_size"] * f["embed_dim"] * (1 if f["tie_embeddings"] else 2)
  return (layers or f["num_layers"]) * block + embed + f["embed_dim"]


def run_script_here(script, argv) -> tuple[int, str]:
  """Runs benchmarks/<script> as `python script *argv` would, inside this test process: its
  prologue accepts the running JAX when the device count is the one the script asks for (the
  suite's 8), so it shares this process's imports and compiled programs instead of starting a
  new interpreter and JAX; what it changes of argv, sys.path and the environment (variables a
  script sets for its own children) is put back after it. Returns the exit status and what it
  printed."""
  printed = io.StringIO()
  saved_argv, saved_path, saved_env = sys.argv, list(sys.path), dict(os.environ)
  sys.argv = [str(script), *map(str, argv)]
  try:
    with contextlib.redirect_stdout(printed):
      runpy.run_path(str(script), run_name="__main__")
      status = 0
  except SystemExit as stop:
    status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
  finally:
    sys.argv, sys.path[:] = saved_argv, saved_path
    os.environ.clear()
    os.environ.update(saved_env)
  return status, printed.getvalue()
