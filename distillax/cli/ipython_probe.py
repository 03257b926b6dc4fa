"""flax imported without its IPython probe, for a command-line process.

At import, flax.nnx asks whether an IPython shell runs it, to colour its reprs
(flax/nnx/reprlib.supports_color): where IPython is installed, as on the lent TPU VM's image,
that import of IPython cost 1.3 s of distillax train's start (chip call 35: 5.3 s of imports).
A `distillax` process runs in no IPython shell, so the answer is known: while flax imports,
IPython reads as not installed, and it is importable again afterwards. A process that has
imported IPython already (a notebook calling distillax.main) keeps the probe.
"""

from __future__ import annotations

import sys


def import_flax_without_ipython_probe() -> None:
  if "IPython" in sys.modules:
    import flax.nnx  # noqa: F401,PLC0415
    return
  sys.modules["IPython"] = None  # `import IPython` raises ImportError
  try:
    import flax.nnx  # noqa: F401,PLC0415
  finally:
    if sys.modules.get("IPython", ...) is None:
      del sys.modules["IPython"]
