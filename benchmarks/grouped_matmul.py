"""Which grouped matmul should run a TPU's experts? Each kernel at the MoE rows' expert shapes,
forward and forward + backward, against a batched matmul of the same FLOPs.

  python benchmarks/grouped_matmul.py [--shapes student,teacher] [--tilings 128x128x128,...]
      [--reps 5] [--json PATH (default benchmarks/results/grouped_matmul.json)] [--quick]

The shapes are benchmarks/accelerator.py's MoE rows (benchmarks/lib/lever_grid.py's pairs):
`student`, the 16-expert 0.50B student's train step at 8 x 2048 (M = 65,536 routed rows, top-4,
width 1024, expert width 768); `teacher`, the 16-expert teacher's forward in the KD step at
4 x 2048 (M = 32,768, width 2048). One expert FFN is three grouped matmuls (gate and up: D -> F,
down: F -> D), all three timed in one program, bf16 operands with fp32 accumulation as the
model runs them. Group sizes come from a uniform random router (each token's k distinct
experts), the near-balance a trained router keeps.

Kernels:
- `ragged`: jax.lax.ragged_dot (model.moe_impl='ragged'; the TPU compiler's Mosaic kernel);
- `ragged_fused_gate_up`: the same with gate and up as one grouped matmul over (E, D, 2F)
  (on a v5e at the student's shapes slower than `ragged`: 13.86 against 12.02 ms forward and
  backward, results/tpu/grouped_matmul_call51.jsonl, so the model keeps them apart);
- `megablox:TMxTKxTN`: the Pallas grouped matmul in jax.experimental.pallas.ops.tpu.megablox
  (MaxText's `gmm`) with those tiles (0: the whole dimension, at most the dimension), its own
  custom VJP (gmm for the input, tgmm for the weights);
- `tokamax`: tokamax.ragged_dot's Mosaic kernel at its default tiles (when installed);
- `balanced`: einsum over (E, M/E, D) groups of exactly equal size, the same FLOPs with no
  raggedness: what the MXU reaches on these shapes, the baseline every ratio is taken to.
Each row: median ms per call (interleaved rounds), TFLOP/s of the grouped matmuls' own FLOPs,
the ratio to `balanced`, and the largest difference of its outputs and gradients from
`ragged`'s (relative to the largest entry). On a CPU it runs tiny shapes in Pallas'
interpreter: a check of the bookkeeping and the numbers, not of speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox_ops  # noqa: E402

from benchmarks.lib import common  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"student": dict(tokens=8 * 2048, k=4, experts=16, embed=1024, mlp=768),
          "teacher": dict(tokens=4 * 2048, k=4, experts=16, embed=2048, mlp=768)}
QUICK_SHAPES = {"student": dict(tokens=64, k=2, experts=4, embed=128, mlp=128)}
DEFAULT_TILINGS = "128x128x128,256x0x0,512x0x0,1024x0x0,512x512x256"


def group_sizes(tokens: int, k: int, experts: int, seed: int = 0) -> np.ndarray:
  """Rows per expert when each token picks k distinct experts uniformly at random."""
  rng = np.random.default_rng(seed)
  picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k]
  return np.bincount(picks.ravel(), minlength=experts).astype(np.int32)


def _megablox(tiling, interpret: bool):
  def grouped(lhs_MxK, rhs_ExKxN, sizes_E):
    tm, tk, tn = (min(t or d, d) for t, d in zip(tiling, (lhs_MxK.shape[0], lhs_MxK.shape[1],
                                                          rhs_ExKxN.shape[2])))
    return megablox_ops.gmm(lhs_MxK, rhs_ExKxN, sizes_E, jnp.float32, (tm, tk, tn), None, None,
                            False, interpret)
  return grouped


def _tokamax():
  import tokamax  # noqa: PLC0415 (optional: the tokamax extra)
  return lambda lhs, rhs, sizes: tokamax.ragged_dot(
      lhs, rhs, sizes, preferred_element_type=jnp.float32, implementation=("mosaic_tpu",))


def _ragged(lhs, rhs, sizes):
  return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)


def _balanced(lhs_MxK, rhs_ExKxN, sizes_E):
  E = rhs_ExKxN.shape[0]
  return jnp.einsum("emk,ekn->emn", lhs_MxK.reshape(E, -1, lhs_MxK.shape[1]), rhs_ExKxN,
                    preferred_element_type=jnp.float32).reshape(lhs_MxK.shape[0], -1)


def expert_ffn(grouped, fuse_gate_up: bool = False):
  """The experts' gated MLP over sorted rows as the model runs it: a loss against a fixed
  cotangent, so its gradient is one backward pass of the three grouped matmuls. fuse_gate_up:
  gate and up as one grouped matmul over their weights side by side (E, D, 2F), a wider
  product for the MXU and one read of the rows instead of two."""
  def loss(x_MxD, gate_ExDxF, up_ExDxF, down_ExFxD, sizes_E, cot_MxD):
    if fuse_gate_up:
      F = gate_ExDxF.shape[-1]
      both = grouped(x_MxD, jnp.concatenate([gate_ExDxF, up_ExDxF], axis=-1), sizes_E)
      g, u = both[:, :F], both[:, F:]
    else:
      g = grouped(x_MxD, gate_ExDxF, sizes_E)
      u = grouped(x_MxD, up_ExDxF, sizes_E)
    h = (jax.nn.silu(g) * u).astype(x_MxD.dtype)
    out = grouped(h, down_ExFxD, sizes_E)
    return jnp.sum(out * cot_MxD)
  return loss


def _operands(shape: dict, balanced: bool):
  M, D, F, E = shape["tokens"] * shape["k"], shape["embed"], shape["mlp"], shape["experts"]
  keys = jax.random.split(jax.random.key(0), 5)
  bf = jnp.bfloat16
  x = jax.random.normal(keys[0], (M, D), bf)
  w = [(jax.random.normal(keys[i], s, bf) / np.sqrt(s[1])).astype(bf)
       for i, s in ((1, (E, D, F)), (2, (E, D, F)), (3, (E, F, D)))]
  cot = jax.random.normal(keys[4], (M, D), jnp.float32)
  sizes = (np.full(E, M // E, np.int32) if balanced
           else group_sizes(shape["tokens"], shape["k"], E))
  return (x, *w, jnp.asarray(sizes), cot), 3 * 2 * M * D * F


def _compiled(kernel, args, backward: bool):
  fn = expert_ffn(*kernel) if isinstance(kernel, tuple) else expert_ffn(kernel)
  loss = fn
  fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3)) if backward else lambda *a: (loss(*a),)
  return jax.jit(fn).lower(*args).compile()


def _max_rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run(shapes, tilings, reps: int, quick: bool, out_path: Path | None):
  interpret = jax.default_backend() != "tpu"
  kernels = {"ragged": _ragged, "ragged_fused_gate_up": (_ragged, True), "balanced": _balanced}
  kernels.update({f"megablox:{'x'.join(map(str, t))}": _megablox(t, interpret) for t in tilings})
  if not interpret:
    try:
      kernels["tokamax"] = _tokamax()
    except ImportError:
      pass
  rows = []
  for shape_name in shapes:
    shape = (QUICK_SHAPES if quick else SHAPES)[shape_name]
    args, flops_fwd = _operands(shape, balanced=False)
    balanced_args, _ = _operands(shape, balanced=True)
    for backward in (False, True):
      compiled, errors = {}, {}
      for name, kernel in kernels.items():
        a = balanced_args if name == "balanced" else args
        try:
          compiled[name] = (_compiled(kernel, a, backward), a)
        except Exception as e:  # a tiling the kernel refuses: its own row says why
          errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
      found, times, results = common.compiled_side_by_side(compiled, reps=reps)
      want = results.get("ragged")
      for name in kernels:
        row = {"shape": shape_name, **shape, "pass": "forward+backward" if backward else "forward",
               "kernel": name, "backend": jax.default_backend(),
               "device_kind": jax.devices()[0].device_kind}
        if name in errors:
          row["error"] = errors[name]
        else:
          r = found[name]
          flops = flops_fwd * (3 if backward else 1)
          row.update(ms=1e3 * r["step_s"], tflops_per_s=flops / r["step_s"] / 1e12,
                     vs_balanced=common.paired_ratio(times, name, "balanced"),
                     temp_bytes=r["temp_bytes"])
          if name != "balanced" and want is not None:
            row["max_rel_diff_vs_ragged"] = max(
                _max_rel(g, w) for g, w in zip(jax.tree.leaves(results[name]),
                                               jax.tree.leaves(want)))
        rows.append(row)
        common.emit_row(row, out_path)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="student,teacher")
  p.add_argument("--tilings", default=DEFAULT_TILINGS)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--jsonl", type=Path, default=None, help="append each row as it finishes")
  p.add_argument("--json", type=Path, default=None)
  p.add_argument("--devices", type=int, default=None)
  a = p.parse_args(argv)
  quick = a.quick or jax.default_backend() != "tpu"
  shapes = ["student"] if quick else a.shapes.split(",")
  tilings = [tuple(int(v) for v in t.split("x")) for t in a.tilings.split(",") if t]
  if quick:
    tilings = tilings[:2]
  rows = run(shapes, tilings, a.reps if not quick else 1, quick, a.jsonl)
  out = a.json or RESULTS / ("grouped_matmul_quick.json" if quick else "grouped_matmul.json")
  payload = {"machine": common.machine_info(), "rows": rows}
  common.write_json(out.parent, out.stem, payload)
  return payload


if __name__ == "__main__":
  main()
