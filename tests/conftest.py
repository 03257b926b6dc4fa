"""Every test runs on 8 simulated CPU devices; this must happen before JAX is imported.

The devices are simulated the way `distillax --devices 8` does it (distillax.main, which imports
no JAX), so the suite also gets its patient collectives: 8 devices on a loaded 2-core machine
must not abort on XLA:CPU's default collective deadline.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from distillax.main import _preset_devices  # noqa: E402

assert _preset_devices(["--devices=8"]) is None

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
