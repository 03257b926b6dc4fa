"""How fast does the sampler decode, against the HBM roofline of its batch?

  python benchmarks/sampler_decode.py [--rows 16,32] [--prompt 512] [--new 256]
      [--pair real|tiny] [--cache-dtype int8] [--profile DIR]
      [--json PATH (default benchmarks/results/sampler_decode.json)]

The student of the accelerator benchmark's pair (benchmarks/lib/lever_grid.py; `real` is the
Qwen3-0.6B shape) decodes with models/sampler.decode as on-policy distillation runs it: bf16
weights cast once, temperature 1 over the tokenizer's ids (vocab_limit), a stop token never
drawn, so every row decodes all `--new` tokens. Each row count runs three programs: the prefill
alone (one new token), greedy decoding, and sampled decoding; a decode step's time is the
whole call's less the prefill's, over the new tokens after the first. Greedy against sampled
shows what the draw costs; the roofline (benchmarks/lib/on_policy_lever.decode_roofline) is
what reading the weights and each row's cache at every step allows. `--profile DIR` keeps a
jax.profiler trace of the last row count's sampled call (read it with scripts/profile_ops.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.lib import common, lever_grid, on_policy_lever  # noqa: E402
from distillax.framework import throughput  # noqa: E402
from distillax.models.sampler import SamplingConfig, decode, weights_in_compute_dtype  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "results"


def program(graphdef, cfg: SamplingConfig, cache_dtype: str | None):
  """The jitted decode of the model whose state is passed in, weights cast once inside."""
  def run(state, prompt_BxP, lengths_B, key):
    model = weights_in_compute_dtype(nnx.merge(graphdef, state))
    out = decode(model, prompt_BxP, lengths_B, key, cfg, cache_dtype)
    return out.lengths_B, out.tokens_BxT
  return jax.jit(run)


def measure(graphdef, state, student_cfg, rows: int, prompt: int, new: int, reps: int,
            profile_dir: str | None, cache_dtype: str | None = None) -> dict:
  V = student_cfg.vocab_size
  rng = np.random.default_rng(0)
  prompt_BxP = jnp.asarray(rng.integers(1, V - 1, (rows, prompt)), jnp.int32)
  args = (state, prompt_BxP, jnp.full((rows,), prompt, jnp.int32), jax.random.key(0))
  base = dict(eos_id=V - 1, vocab_limit=V - 1)
  prefill = program(graphdef, SamplingConfig(1, 1.0, **base), cache_dtype)
  prefill_s = common.median_call_seconds(prefill, args, reps)
  row = {"rows": rows, "prompt": prompt, "new_tokens": new, "prefill_s": prefill_s,
         "cache_dtype": cache_dtype or student_cfg.dtype}
  for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
    fn = program(graphdef, SamplingConfig(new, temperature, **base), cache_dtype)
    whole_s = common.median_call_seconds(fn, args, reps)
    row[f"{name}_s"] = whole_s
    row[f"{name}_step_ms"] = 1e3 * (whole_s - prefill_s) / (new - 1)
  roof = on_policy_lever.decode_roofline(
      on_policy_lever.decode_weight_bytes(student_cfg),
      on_policy_lever.kv_bytes_per_position(student_cfg, cache_dtype), rows, prompt, new,
      throughput.hbm_bandwidth_per_device()[0])
  row.update(roof)
  if roof["roofline_tokens_per_s"]:
    roof_step_ms = 1e3 * roof["decode_bytes_per_step"] / roof["hbm_bandwidth"]
    row["roofline_step_ms"] = roof_step_ms
    for name in ("greedy", "sampled"):
      row[f"{name}_of_roofline"] = roof_step_ms / row[f"{name}_step_ms"]
  if profile_dir:
    fn = program(graphdef, SamplingConfig(new, 1.0, **base), cache_dtype)
    jax.block_until_ready(fn(*args))
    jax.profiler.start_trace(profile_dir)
    try:
      jax.block_until_ready(fn(*args))
    finally:
      jax.profiler.stop_trace()
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="16,32")
  parser.add_argument("--prompt", type=int, default=512)
  parser.add_argument("--new", type=int, default=256)
  parser.add_argument("--pair", default="real", choices=("real", "tiny"))
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--cache-dtype", default=None, help="the KV cache's: int8, or the compute "
                      "dtype (default)")
  parser.add_argument("--profile", default="", help="trace the last row count's sampled call")
  parser.add_argument("--json", default=str(RESULTS / "sampler_decode.json"),
                      help="result file (default: benchmarks/results/sampler_decode.json)")
  parser.add_argument("--devices", default=None, help=argparse.SUPPRESS)  # the prologue's
  args = parser.parse_args(argv)
  student_cfg = lever_grid.pair_configs("real", tiny=args.pair == "tiny")["student"]
  graphdef, state = nnx.split(lever_grid.ModelFactory(student_cfg).make())
  counts = [int(r) for r in args.rows.split(",")]
  rows = []
  for i, n in enumerate(counts):
    profile = args.profile if args.profile and i == len(counts) - 1 else None
    rows.append(measure(graphdef, state, student_cfg, n, args.prompt, args.new, args.reps,
                        profile, args.cache_dtype))
    print(json.dumps(rows[-1]), flush=True)
  Path(args.json).write_text(json.dumps({"device": jax.devices()[0].device_kind,
                                         "argv": sys.argv, "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
