"""What the question scripts in benchmarks/ share; nothing here is a question of its own.

- prologue: simulated devices, set before JAX starts (every script imports it first).
- subproc: one child process per device count, and the flags every script shares.
- common: batches, engines, interleaved timing, tables, JSON.
- variants: job variants built through their recipe (peft.py, qat.py).
- backend_suite (step.py, backends.py), baseline (step.py's hand-written step),
  sharding_checks (scaling.py), tunix_kd (kd_vocab.py's optional Tunix side).
- lever_grid (tpu_levers.py and accelerator.py: model pairs, step variants, one shared state),
  accelerator_measure (the chip probe and platform check), accelerator_table (accelerator.py's
  report; `python benchmarks/lib/accelerator_table.py RESULT.json` prints it again).
- Processes of their own: accelerator_deps (the wheels scripts/accelerator_run.sh installs) and
  on_policy_trl (TRL's side of on_policy.py, in another interpreter).
"""
