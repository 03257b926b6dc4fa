"""`distillax plan`: a run sized before it runs, on this host's simulated devices (local) or by a
TPU's or GPU's own compiler (--target), with --search for the batch and remat that fit."""
