"""Qwen3.5's Gated DeltaNet layer: the chunked training form against a naive recurrent scan.

  python benchmarks/linear_attention.py [--quick] [--devices N]

One Gated DeltaNet token mixer (`models.gated_deltanet.GatedDeltaNet`: projections, causal conv,
the gated delta rule, gated RMSNorm, output projection), forward and backward (the loss is the
output against a fixed random cotangent; gradients for the weights and the input), at
1 x 8192 tokens, width D = 256, 2 key heads over 4 value heads of 64 features (the whole script
runs in a few minutes on two cores). `linear_attention_impl='chunked'` (chunk 64) solves each
chunk's 64 updates as one triangular system and scans over the 128 chunks;
`linear_attention_impl='recurrent'` scans over the 8192 tokens one at a time, so its backward
pass keeps every token's (heads, d_k, d_v) state. Both must give the same loss and gradients
(checked). Reported: the compiled temporaries (`memory_analysis().temp_size_in_bytes`), the step
time (median of interleaved rounds, and the median of per-round ratios) and XLA's FLOP count.
One run; the machine's load average is recorded with it. Writes
benchmarks/results/linear_attention.json (--quick: linear_attention_quick.json).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax import partitioning as pt  # noqa: E402
from distillax.models import TransformerConfig  # noqa: E402
from distillax.models.gated_deltanet import GatedDeltaNet  # noqa: E402

IMPLS = ("chunked", "recurrent")


def settings(quick: bool) -> dict:
  if quick:
    return {"tokens": 128, "embed_dim": 32, "key_heads": 1, "value_heads": 2, "head_dim": 16,
            "chunk": 32, "reps": 2}
  return {"tokens": 8192, "embed_dim": 256, "key_heads": 2, "value_heads": 4, "head_dim": 64,
          "chunk": 64, "reps": 3}


def load() -> list[float]:
  """/proc/loadavg's 1, 5 and 15 minute load averages (empty where there is none)."""
  try:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
  except OSError:
    return []


def layer_config(s: dict, impl: str) -> TransformerConfig:
  return TransformerConfig(
      embed_dim=s["embed_dim"], num_layers=1, token_mixers=("linear_attention",),
      linear_num_key_heads=s["key_heads"], linear_num_value_heads=s["value_heads"],
      linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"],
      linear_attention_impl=impl, linear_attention_chunk=s["chunk"], max_seq_len=s["tokens"])


def layer_step(s: dict, impl: str):
  """(compiled loss-and-gradients of one Gated DeltaNet layer, its arguments); the same
  weights, input and cotangent for every impl."""
  mesh = pt.create_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    graph, params = nnx.split(GatedDeltaNet(layer_config(s, impl), rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  x_1xLxD = jnp.asarray(rng.normal(size=(1, s["tokens"], s["embed_dim"])), jnp.float32)
  cot_1xLxD = jnp.asarray(rng.normal(size=(1, s["tokens"], s["embed_dim"])), jnp.float32)

  def loss(params, x_1xLxD, cot_1xLxD):  # the cotangent an argument: no constant folding
    out_1xLxD, _, _ = nnx.merge(graph, params)(x_1xLxD)
    return jnp.sum(out_1xLxD * cot_1xLxD)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  args = (params, x_1xLxD, cot_1xLxD)
  return fn.lower(*args).compile(), args


def measure_layer(s: dict) -> dict:
  rows, times, results = common.compiled_side_by_side(
      {impl: layer_step(s, impl) for impl in IMPLS}, reps=s["reps"])
  loss_diff, grad_diff = common.value_and_grad_gaps(results["chunked"], results["recurrent"])
  return {**{k: s[k] for k in ("tokens", "embed_dim", "key_heads", "value_heads", "head_dim",
                               "chunk")},
          "rows": list(rows.values()),
          "time_chunked_over_recurrent": common.paired_ratio(times, "chunked", "recurrent"),
          "temp_chunked_over_recurrent": (rows["chunked"]["temp_bytes"]
                                          / rows["recurrent"]["temp_bytes"]),
          "check": {"loss_rel_diff": loss_diff, "grad_rel_diff": grad_diff,
                    "pass": loss_diff <= 1e-4 and grad_diff <= 1e-4}}


def main() -> int:
  args = subproc.parse_args(subproc.base_parser(__doc__.splitlines()[0]))
  s = settings(args.quick)
  load_before = load()
  print(f"load average {load_before}; one Gated DeltaNet layer, chunked and recurrent ...",
        flush=True)
  layer = measure_layer(s)
  res = {"machine": common.machine_info(), "quick": args.quick, "settings": s,
         "load_before": load_before, "load_after": load(), "layer": layer}
  print(f"\none Gated DeltaNet layer, forward + backward: 1 x {layer['tokens']} tokens, "
        f"D={layer['embed_dim']}, {layer['key_heads']} key / {layer['value_heads']} value heads "
        f"of {layer['head_dim']}, chunk {layer['chunk']}")
  print(common.format_table(layer["rows"], [
      ("linear_attention_impl", lambda r: r["impl"]),
      ("step ms", lambda r: common.fmt_ms(r["step_s"])),
      ("GFLOPs", lambda r: f"{r['flops'] / 1e9:.2f}"),
      ("temporaries", lambda r: common.fmt_bytes(r["temp_bytes"]))]))
  print(f"chunked / recurrent: time {layer['time_chunked_over_recurrent']:.3f} (median of "
        f"per-round ratios), temporaries {layer['temp_chunked_over_recurrent']:.3f}")
  print(f"load average before {load_before}, after {res['load_after']} "
        f"({os.cpu_count()} CPUs)")
  check = layer["check"]
  print(f"{'PASS' if check['pass'] else 'FAIL'}  chunked and recurrent agree (loss rel "
        f"{check['loss_rel_diff']:.1e}, gradients rel {check['grad_rel_diff']:.1e})")
  path = common.write_json(args.out, "linear_attention_quick" if args.quick
                           else "linear_attention", res)
  print(f"\nwrote {path}")
  return 0 if check["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
