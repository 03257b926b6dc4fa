"""Knowledge distillation: composable strategies, the objective, the student wrapper, the cache.

  strategy = LogitKD(temperature=2.0, alpha=0.7) + 0.5 * AttentionTransfer({1: 3})
  student = DistillStudent(model, strategy, teacher_embed_dim=..., rngs=nnx.Rngs(0))
  objective = make_distill_objective(strategy, chunk_size=1024)   # for framework.step
"""

from distillax.distill.attention import AttentionTransfer
from distillax.distill.base import Composite, DistillInputs, Needs, Strategy
from distillax.distill.divergences import DIVERGENCES, divergence
from distillax.distill.features import FeaturePooling, FeatureProjection, Projection
from distillax.distill.logit_kd import (TEACHER_NLL, TOPK_IDS, TOPK_LOGPROBS, CachedLogitKD,
                                        LogitKD, logit_metric_values)
from distillax.distill.objective import TEACHER, make_distill_objective, run_models
from distillax.distill.router_kd import RouterKD
from distillax.distill.student import DistillStudent, unwrap_student
from distillax.distill.teacher_cache import (CacheInfo, read_cache_info, read_teacher_cache,
                                             write_teacher_cache)

__all__ = [
    "AttentionTransfer", "CacheInfo", "CachedLogitKD", "Composite", "DIVERGENCES", "DistillInputs",
    "DistillStudent", "FeaturePooling", "FeatureProjection", "LogitKD", "Needs", "Projection",
    "RouterKD", "Strategy", "TEACHER", "TEACHER_NLL", "TOPK_IDS", "TOPK_LOGPROBS", "divergence",
    "logit_metric_values", "make_distill_objective", "read_cache_info", "read_teacher_cache",
    "run_models", "unwrap_student", "write_teacher_cache",
]
