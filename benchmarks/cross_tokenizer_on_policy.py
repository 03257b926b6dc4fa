"""Cross-tokenizer on-policy distillation: what does the host between sampling and scoring cost
against the same-tokenizer on-policy step?

  python benchmarks/cross_tokenizer_on_policy.py [--quick] [--reps N]

Both steps are the recipes' own (the engines `distillax train` builds), on one CPU device, over
the same shapes: the tiny student and teacher presets, B prompts of P tokens from the embedded
corpus (512-id BPE student), S samples of T new tokens each, lmbda 1.

  same_tokenizer   configs/on_policy.py:tiny on the student's 512-id BPE, teacher on the same
                   tokenizer: sampling, scoring and update in one compiled step (GeneralizedJSD)
  cross_tokenizer  configs/distill_cross_tokenizer.py:tiny,on_policy, teacher on the 1024-id BPE:
                   the sampling program, the host (decode to bytes, the teacher's tokenizer, the
                   byte alignment: data.cross_tokenizer_samples), then the compiled train step
                   (the cross-tokenizer loss through the vocabulary-chunk engine)
  cross_tokenizer_whole  the same with distill.chunk_size=0: the loss over whole logits

Steps are timed in interleaved rounds (benchmarks/lib/common.interleaved); the cross step's own
split comes from its metrics (sampling_s, host_alignment_s: the host clock around the sampling
program and the host work, each step). Writes benchmarks/results/cross_tokenizer_on_policy.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from benchmarks.lib import prologue  # noqa: E402

prologue.start(__name__, default_devices=1)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.lib import common, subproc  # noqa: E402
from distillax.configs import distill_cross_tokenizer, on_policy  # noqa: E402
from distillax.partitioning import create_mesh  # noqa: E402
from distillax.trainers import recipe_for  # noqa: E402

NAME = "cross_tokenizer_on_policy"


def settings(quick: bool) -> dict:
  if quick:
    return {"batch": 2, "prompt_len": 8, "max_new_tokens": 8, "num_samples": 1, "reps": 2,
            "steps_per_rep": 2}
  return {"batch": 8, "prompt_len": 8, "max_new_tokens": 16, "num_samples": 2, "reps": 5,
          "steps_per_rep": 5}


def configs(s: dict):
  cross = distill_cross_tokenizer.get_config("tiny,on_policy")
  same = on_policy.get_config("tiny")
  same.data.tokenizer = cross.data.tokenizer  # the student's 512-id BPE on both sides
  same.model.vocab_size = 0
  same.on_policy.time_sampling = False
  for c in (cross, same):
    c.train.batch_size = s["batch"]
    c.on_policy.prompt_len, c.on_policy.max_new_tokens = s["prompt_len"], s["max_new_tokens"]
    c.on_policy.num_samples = s["num_samples"]
  whole = cross.copy_and_resolve_references()
  whole.distill.chunk_size = 0
  return {"same_tokenizer": same, "cross_tokenizer": cross, "cross_tokenizer_whole": whole}


class RecipeStepper:
  """A recipe's train step on one batch of its own prompts, keeping the state and the last
  step's metrics."""

  def __init__(self, config):
    self.recipe = recipe_for(config, mesh=create_mesh(config.mesh, devices=jax.devices()[:1]))
    student, extras = self.recipe.build(abstract=False)
    self.engine = self.recipe.build_engines().main
    self.state = self.engine.init_state(student, extras, int(config.seed))
    self.batch = self.engine.runner.place_batch(next(self.recipe.train_iterator()))
    self.metrics, self.host = {}, {"sampling_s": [], "host_alignment_s": []}

  def __call__(self, steps: int) -> None:
    state = self.state
    for _ in range(steps):
      state, metrics = self.engine.runner(state, self.batch)
      for key, values in self.host.items():
        if key in metrics:
          values.append(float(metrics[key]))
    self.state, self.metrics = jax.block_until_ready((state, metrics))


def measure(s: dict) -> dict:
  steppers = {name: RecipeStepper(c) for name, c in configs(s).items()}
  times, warmup = common.interleaved(steppers, reps=s["reps"], steps_per_rep=s["steps_per_rep"])
  rows = {}
  for name, stepper in steppers.items():
    step_s = common.median(times[name])
    rows[name] = {"step_s": step_s, "steps_per_s": 1.0 / step_s, "step_s_all": times[name],
                  "warmup_s": warmup[name], "final_loss": float(stepper.metrics["loss"])}
    for key, values in stepper.host.items():
      if values:
        rows[name][key] = common.median(values[2:] or values)  # past the warm-up steps
  for name in ("cross_tokenizer", "cross_tokenizer_whole"):
    rows[name]["ratio_to_same"] = common.paired_ratio(times, name, "same_tokenizer")
    rows[name]["host_alignment_share"] = rows[name]["host_alignment_s"] / rows[name]["step_s"]
  return rows


def main(argv=None) -> None:
  parser = subproc.base_parser(__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=None, help="timed rounds (default by size)")
  args = subproc.parse_args(parser, argv)
  s = settings(args.quick)
  if args.reps:
    s["reps"] = args.reps
  rows = measure(s)
  cell = lambda key, fmt: (lambda r: fmt(r[key]) if key in r else "-")
  print(common.format_table(
      [{"step": name, **r} for name, r in rows.items()],
      [("step", lambda r: r["step"]), ("step ms", cell("step_s", common.fmt_ms)),
       ("steps/s", cell("steps_per_s", lambda x: f"{x:.2f}")),
       ("sampling ms", cell("sampling_s", common.fmt_ms)),
       ("host alignment ms", cell("host_alignment_s", common.fmt_ms)),
       ("vs same tokenizer", cell("ratio_to_same", common.fmt_ratio))]))
  tokens = s["batch"] * s["num_samples"] * s["max_new_tokens"]
  common.write_json(args.out, NAME, {"settings": s, "sampled_tokens_per_step": tokens,
                                     "rows": rows, "machine": common.machine_info()})


if __name__ == "__main__":
  main()
