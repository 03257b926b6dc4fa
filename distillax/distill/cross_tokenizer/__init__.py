"""Distillation between a student and a teacher with different tokenizers: the aligned-span
losses, their vocabulary-chunk form, the objective and its on-policy form."""
