"""The routed experts' dispatch as the TPU compiler lays it out: a deviceless compile for a v5e
(libtpu, the aot extra; compile-only devices on this CPU host) of one MoE layer's values and
gradients. The assignments run slot-major (models/moe/parallel.routed_experts), so the expert
outputs come back to their tokens as (k, T, D) by splitting the leading axis; token-major rows
reshaped to (T, k, D) put k on the TPU's sublanes, and the compiler copied every expert output
into that layout and back (the 0.50B MoE student's step had three such copies per layer). And
the rows' gradients gather through the inverse permutation (models/moe/dispatch_rows.py): no
scatter of rows in the backward."""

import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from distillax.framework import targets
from distillax.models.moe.parallel import routed_experts
from distillax.models.moe.routing import route


def _top_level_ops(hlo_text: str):
  """(opcode, shape) of every instruction outside fused computations."""
  for comp in re.split(r"\n(?=\S)", hlo_text):
    head = comp.split("\n", 1)[0]
    if "fused_computation" in head or head.startswith("%region") or "wrapped" in head:
      continue
    for line in comp.split("\n")[1:]:
      m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)
      if m:
        yield m.group(2), m.group(1)


T, D, E, F, k = 2048, 256, 8, 256, 4


@functools.cache
def _compiled_layer() -> str:
  """One MoE layer's values and gradients compiled for a v5e: T = 2048 tokens, 8 experts,
  k = 4, width 256, bf16."""
  device = targets.target_devices(targets.parse_target("tpu:v5e-1"))[0]

  def loss(x, router, gate, up, down):
    routing = route(x.astype(jnp.float32) @ router, k, "softmax_topk", True)
    out = routed_experts(x, routing, gate, up, down, jax.nn.silu)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))

  args = (spec(T, D), jax.ShapeDtypeStruct((D, E), jnp.float32,
                                           sharding=SingleDeviceSharding(device)),
          spec(E, D, F), spec(E, D, F), spec(E, F, D))
  # A training step's precision (the suite's 'highest' makes Mosaic refuse bf16 matmuls).
  with jax.default_matmul_precision("default"):
    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile().as_text()


def test_expert_outputs_reach_their_tokens_without_a_relayout_copy_on_a_tpu():
  """No reshape, copy or transpose of the (T * k, D) expert rows outside a fusion in the
  compiled forward and backward (the grouped matmuls, gathers and scatters move them; nothing
  only relays them out)."""
  text = _compiled_layer()
  rows = T * k * D
  moved = [(op, shape) for op, shape in _top_level_ops(text)
           if op in ("reshape", "copy", "transpose") and re.match(r"bf16\[([\d,]+)\]", shape)
           and _elements(shape) == rows]
  assert moved == [], moved
  assert any(op == "custom-call" for op, _ in _top_level_ops(text))  # the grouped matmuls


def _elements(shape: str) -> int:
  dims = re.match(r"\w+\[([\d,]*)\]", shape).group(1)
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n


def test_the_rows_gradients_are_gathers_not_scatters_on_a_tpu():
  """The dispatch's two row copies (tokens into expert order, outputs back) have gathers for
  gradients: no scatter of (T, D) or (T * k, D) bf16 rows anywhere in the compiled step (jnp.take's
  own gradient is a scatter-add, which the TPU runs row by row)."""
  text = _compiled_layer()
  scatters = re.findall(r"= (bf16\[[\d,]+\])\S* scatter\(", text)
  assert [s for s in scatters if _elements(s) in (T * D, T * k * D)] == [], scatters
  assert len(re.findall(r"= bf16\[[\d,]+\]\S* gather\(", text)) >= 3  # the copies are there


def _row_gather_sources(text: str):
  """Rows of the source of every fusion that gathers (R, D) bf16 rows, by the fusion's first
  operand's shape (every instruction's shape read from its definition)."""
  shapes = dict(re.findall(r"(%[\w.\-]+) = (\w+\[[\d,]*\])", text))
  bodies = dict(re.findall(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S))
  for line in text.split("\n"):
    m = re.search(r"= bf16\[\d+,%d\]\S* fusion\((%%[\w.\-]+).*calls=(%%[\w.\-]+)" % D, line)
    if m and " gather(" in bodies.get(m.group(2), ""):
      yield int(re.match(r"\w+\[(\d+)", shapes[m.group(1)]).group(1))


def test_only_two_row_gathers_read_the_expert_rows_and_no_count_scatters():
  """Gathers from the (T * k, D) expert rows run ~5x slower on a v5e than from the (T, D) token
  rows, which the chip keeps in VMEM: the outputs' return in the forward and the rows'
  cotangent's in the backward read T * k rows; the combine's backward reads the tokens'
  cotangent (dispatch_rows.combine_rows). The experts' row counts are no scatter-add."""
  text = _compiled_layer()
  sources = sorted(_row_gather_sources(text))
  assert sources == [T, T, T * k, T * k], sources
  assert not re.findall(r"= s32\[\d*\]\S* scatter\(", text)
