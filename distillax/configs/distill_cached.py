"""Distillation from an offline teacher cache: run the teacher once, train without it in memory.

Step 1 runs the teacher over `cache.num_batches` train batches and stores its top-k log-probs at
the distillation temperature; step 2 trains the student from that cache with CachedLogitKD
(eval: hard-label CE on the validation split). Teacher from an earlier run of
distillax/configs/lm.py with the demo_teacher model:
  distillax cache-teacher --config distillax/configs/distill_cached.py --workdir runs/kd_cache \
      --config.teacher.workdir=runs/teacher
  distillax train --config distillax/configs/distill_cached.py --workdir runs/kd_cached \
      --config.teacher.cache_dir=runs/kd_cache
Without teacher.cache_dir the same config distils online with LogitKD(top_k=cache.top_k), the
loss the cache reproduces. With `--kind hidden` (cache.kind) cache-teacher stores the teacher's
final hidden states (cache.dtype) and its LM head instead: training from that cache computes the
teacher's exact logits, so any distill.logit settings work (top_k=0 for the full vocabulary).
A seconds-long pair with a fresh tiny teacher:
  distillax cache-teacher --config distillax/configs/distill_cached.py:tiny \
      --workdir runs/cache_tiny
  distillax train --config distillax/configs/distill_cached.py:tiny --workdir runs/kd_cached_tiny \
      --config.teacher.cache_dir=runs/cache_tiny
"""

from distillax.configs import distill
from distillax.configs.common import parse_arg


def get_config(arg: str | None = None):
  c = distill.get_config(arg)
  c.cache.num_batches = 200  # 200 x 16 x 128 tokens: the steps of the default run, once each
  if parse_arg(arg, tiny=False).tiny:
    c.cache.num_batches = 4  # 32 rows: the 6 steps wrap into a reshuffled second epoch
    c.cache.top_k = 16
  c.distill.logit.top_k = c.cache.top_k  # online fallback computes the loss the cache stores
  return c
