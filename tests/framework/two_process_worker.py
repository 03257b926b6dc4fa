"""One of two processes of the multi-process test: STEPS fsdp steps, then STEPS dp steps reducing
gradients once per step (accumulating 2), losses written as JSON."""

import json
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")

from distillax.framework.run import runtime  # noqa: E402

STEPS = 4  # a few optimizer updates: enough for the two runs' losses to part if a reduction errs


def main(out_path: str) -> None:
  assert runtime.initialize(timeout_s=300), "expected a multi-process launch"
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  from tests.support.engines import packed_batches, run_training
  losses, params, _ = run_training("jit", "fsdp", (8, 1), packed_batches(STEPS))
  # The per-worker jit path (shard_map over data spanning both processes), accumulating.
  per_step, _, engine = run_training("jit", "dp", (4, 2), packed_batches(STEPS), accum_steps=2)
  assert engine.runner.gradient_reduction == "per_step"
  if runtime.is_primary():
    with open(out_path, "w") as f:
      json.dump({"losses": losses.tolist(), "per_step_losses": per_step.tolist(),
                 "processes": jax.process_count()}, f)


if __name__ == "__main__":
  main(sys.argv[1])
