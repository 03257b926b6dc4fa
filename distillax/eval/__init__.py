"""`distillax eval` and everything it runs: the exact validation loss, lm-eval tasks through
distillax's own forward and sampler, --against (quantization fidelity), --generate (BLEU/chrF)."""
