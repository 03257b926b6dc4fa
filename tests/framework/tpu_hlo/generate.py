"""Writes the TPU HLO fixtures of tests/framework/test_hlo_tpu.py: small JAX programs compiled by
the TPU compiler (libtpu, deviceless, from a CPU host: the `aot` extra), their module text trimmed
to what the HLO reader reads.

  python tests/framework/tpu_hlo/generate.py

Trimming drops only attributes the reader never reads (metadata, frontend attributes, shardings,
source-target pairs, layouts and memory spaces, backend configs but an all-reduce-scatter
fusion's emitter) and the fused
computations that hold no collective, matmul or loop (their callers lose the `calls=`); every
instruction of the computations kept stays as the compiler wrote it. Each file starts with the
program that produced it. The expected figures are worked out by hand in the test, not read
from here.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

HERE = Path(__file__).resolve().parent
BF16 = jnp.bfloat16


def _mesh(topology: str) -> Mesh:
  devices = topologies.get_topology_desc(
      topology_name=topology, platform="tpu", chip_config_name="default",
      chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False)).devices
  return Mesh(np.array(devices), ("data",))


def _arg(shape, sharding):
  return jax.ShapeDtypeStruct(shape, BF16, sharding=sharding)


def collective_matmul() -> str:
  """x[16,2048,2048] @ w[2048,8192] on v5e:2x4, both split over 'data' on their first dim (w:
  FSDP): the TPU compiler makes the gather of w a collective matmul (windowed_dot_general)."""
  mesh = _mesh("v5e:2x4")
  rows, cols = NamedSharding(mesh, P("data", None, None)), NamedSharding(mesh, P("data", None))
  fn = jax.jit(lambda x, w: jnp.einsum("bld,df->blf", x, w), out_shardings=rows)
  return fn.lower(_arg((16, 2048, 2048), rows), _arg((2048, 8192), cols)).compile().as_text()


def _stack_loss(w, x):
  def layer(h, w_l):
    return jnp.tanh(h @ w_l), None
  return jnp.sum(jax.lax.scan(layer, x, w)[0].astype(jnp.float32))


def scanned_fsdp() -> str:
  """One SGD step of a scanned stack of 3 layers h = tanh(h @ w_l), w[3,512,512] split over
  'data' on dim 1 (FSDP) and x[64,512] on dim 0, on v5e:2x2: async all-gathers of each layer's
  weights, all-reduce-scatter fusions of their gradients."""
  mesh = _mesh("v5e:2x2")
  ws, xs = NamedSharding(mesh, P(None, "data", None)), NamedSharding(mesh, P("data", None))
  step = lambda w, x: w - 0.1 * jax.grad(_stack_loss)(w, x)
  fn = jax.jit(step, out_shardings=ws)
  return fn.lower(_arg((3, 512, 512), ws), _arg((64, 512), xs)).compile().as_text()


def scanned_mlp() -> str:
  """One SGD step of a scanned stack of 2 layers h = tanh(h @ a_l) @ b_l, a[2,2048,8192] and
  b[2,8192,2048] split over 'data' on dim 1 (FSDP), x[16,2048,2048] on dim 0, on v5e:2x4:
  collective matmuls inside the layer loop, and an async all-gather whose continuation runs
  inside a collective matmul's loop."""
  mesh = _mesh("v5e:2x4")
  ws, xs = NamedSharding(mesh, P(None, "data", None)), NamedSharding(mesh, P("data", None, None))

  def loss(w, x):
    def layer(h, ab):
      return jnp.tanh(h @ ab[0]) @ ab[1], None
    return jnp.sum(jax.lax.scan(layer, x, w)[0].astype(jnp.float32))

  step = lambda w, x: jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w, x))
  fn = jax.jit(step, out_shardings=(ws, ws))
  w = (_arg((2, 2048, 8192), ws), _arg((2, 8192, 2048), ws))
  return fn.lower(w, _arg((16, 2048, 2048), xs)).compile().as_text()


# ---- trimming -----------------------------------------------------------------------------

_KEEP_OPS = re.compile(r"\b(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
                       r"|dot|convolution|while)(-start|-done)?\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*->.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|condition|body)=%([\w.\-]+)")
_EMITTER = re.compile(r'"emitter"\s*:\s*"(\w*AllReduceScatterFusion)"')


def _drop_attr(line: str, name: str) -> str:
  """`line` without `, name=<value>` (a balanced {...}, a "...", or a bare token)."""
  while (at := line.find(f", {name}=")) >= 0:
    i = at + len(name) + 3
    if line[i] in "{\"":
      close, depth = {"{": "}", "\"": "\""}[line[i]], 0
      for j in range(i, len(line)):
        if line[i] == "{":
          depth += {"{": 1, "}": -1}.get(line[j], 0)
          if depth == 0:
            break
        elif j > i and line[j] == close:
          break
      end = j + 1
    else:
      end = len(line) if (k := line.find(",", i)) < 0 else k
    line = line[:at] + line[end:]
  return line


def _clean(line: str) -> str:
  emitter = _EMITTER.search(line)
  for name in ("metadata", "backend_config", "frontend_attributes", "sharding",
               "source_target_pairs", "statistics_viz"):
    line = _drop_attr(line, name)
  if emitter:
    line += ', backend_config={"collective_algorithm_config":{"emitter":"%s"}}' % emitter.group(1)
  line = re.sub(r"/\*index=\d+\*/", "", line)
  return re.sub(r"(\[[0-9,]*\])\{[^{}]*\}", r"\1", line)  # layouts and memory spaces


def trim(text: str) -> str:
  """The module text the reader needs (see the module docstring)."""
  comps: dict[str, list[str]] = {}
  order, current = [], None
  for line in text.splitlines():
    if current is None:
      if (m := _HEADER.match(line)):
        current = m.group(2)
        comps[current] = [line]
        order.append(current)
      continue
    comps[current].append(line)
    if line.strip() == "}":
      current = None
  callees = {c: {m.group(2) for line in lines for m in _CALLEE.finditer(line)}
             for c, lines in comps.items()}
  keep = {c for c, lines in comps.items()
          if any(_KEEP_OPS.search(line) for line in lines) or lines[0].startswith("ENTRY")}
  keep |= {b for c in comps for line in comps[c] if "while(" in line
           for b in re.findall(r"\b(?:condition|body)=%([\w.\-]+)", line)}
  grew = True
  while grew:
    grew = False
    for c in comps:
      if c not in keep and callees[c] & keep:
        keep.add(c)
        grew = True
  out = []
  for c in order:
    if c not in keep:
      continue
    for line in comps[c]:
      line = _clean(line)
      for m in list(_CALLEE.finditer(line)):
        if m.group(2) not in keep:
          line = line.replace(f", {m.group(1)}=%{m.group(2)}", "")
      out.append(line)
    out.append("")
  return "\n".join(out)


PROGRAMS = {"collective_matmul": collective_matmul, "scanned_fsdp": scanned_fsdp,
            "scanned_mlp": scanned_mlp}


def main() -> None:
  for name, program in PROGRAMS.items():
    header = "\n".join(f"// {line}" for line in [
        f"{name}: {program.__doc__.split(chr(10))[0]}", *[
            line.strip() for line in program.__doc__.split("\n")[1:]],
        f"Compiled by libtpu (jax {jax.__version__}), trimmed by "
        f"tests/framework/tpu_hlo/generate.py."])
    path = HERE / f"{name}.hlo"
    path.write_text(header + "\n" + trim(program()))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
  sys.exit(main())
