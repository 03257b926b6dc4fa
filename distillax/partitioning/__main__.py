"""`python -m distillax.partitioning`: the sharding plan of a model-shaped tree under each preset.

Runs on 8 simulated CPU devices unless XLA_FLAGS already says otherwise, and also places the tree
for real on each mesh to show that the per-device shards match the plan.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from distillax import partitioning as pt  # noqa: E402
from distillax.partitioning.example import model_shaped_tree  # noqa: E402


def main() -> None:
  abstract, logical = model_shaped_tree()
  n = jax.device_count()
  meshes = [(n, 1), (n // 2, 2)] if n % 2 == 0 and n > 1 else [(n, 1)]
  for strategy in pt.BUILTIN_PRESETS:
    for data, model in meshes:
      mesh = pt.create_mesh({"data": data, "model": model})
      rules = pt.rules_from_config({"strategy": strategy})
      rows = pt.describe(abstract, logical, mesh, rules)
      print(pt.format_plan(rows, f"\n=== preset {strategy}, mesh {data}x{model} (data x model) ==="))
      # Materialise the tree directly sharded (a jit with out_shardings) and read back one shard.
      shardings = pt.tree_shardings(abstract, logical, mesh, rules)
      params = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract),
                       out_shardings=shardings)()
      held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
      planned = sum(r.bytes_per_device for r in rows)
      print(f"device 0 holds {pt.shard.format_bytes(held)} (plan: "
            f"{pt.shard.format_bytes(planned)}) {'OK' if held == planned else 'MISMATCH'}")
      if strategy != "dp" and (strategy != "tp" or model > 1):
        suff = pt.check_sufficiency(rows, raise_on_failure=False)
        print(f"sufficiency: {suff.replicated_fraction:.2%} of bytes replicated "
              f"({'PASS' if suff.ok else 'FAIL'})")



if __name__ == "__main__":
  main()
