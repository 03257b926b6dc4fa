"""Distillation recipes: a frozen teacher in the step, from a teacher cache, with another
tokenizer, or several teachers at once."""
