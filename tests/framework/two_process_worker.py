"""One of two processes of the multi-process test: 10 fsdp steps, losses written as JSON."""

import json
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")

from distillax.framework import runtime  # noqa: E402


def main(out_path: str) -> None:
  assert runtime.initialize(timeout_s=60), "expected a multi-process launch"
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  from tests.framework.engine_fixtures import packed_batches, run_training
  losses, params, _ = run_training("jit", "fsdp", (8, 1), packed_batches(10))
  if runtime.is_primary():
    with open(out_path, "w") as f:
      json.dump({"losses": losses.tolist(), "processes": jax.process_count()}, f)


if __name__ == "__main__":
  main(sys.argv[1])
