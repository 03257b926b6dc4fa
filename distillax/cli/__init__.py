"""The command line's parts, each in its own module, so that distillax/main.py only parses,
resolves and dispatches: the flag tables (flags), `--help` and `--version` (help), the one-line
error wording (error_lines), the `--devices` preset (devices), the platforms JAX may start on
a host without a TPU (host_platforms) and the command -> job table (dispatch). None of them imports JAX when imported: `--devices` must reach XLA_FLAGS first.
"""
