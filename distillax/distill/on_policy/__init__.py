"""On-policy distillation: the step objective that samples with the student and scores with the
teacher, its per-token divergences, and the held-out on-policy evaluation."""
