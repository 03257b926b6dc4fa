"""speculators (the speculators extra) on the import path: `make test` installs it with --no-deps
into .venv/speculators (it asks for an older transformers than the hf extra pins; its eagle3
model does not need one); DISTILLAX_SPECULATORS names another folder."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_speculators_eagle3():
  """(Eagle3DraftModel, Eagle3SpeculatorConfig) of the installed speculators, or a failure that
  says how to install it (never a skip: the export's test needs the package)."""
  folder = os.environ.get("DISTILLAX_SPECULATORS", os.path.join(ROOT, ".venv", "speculators"))
  if os.path.isdir(folder) and folder not in sys.path:
    sys.path.append(folder)
  try:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
  except ImportError as e:
    raise AssertionError(
        f"speculators is not importable from {folder} ({e}); install it as `make test` does: "
        f"pip install --no-deps --target {folder} -c constraints.txt speculators openai sniffio "
        f"hs-connectors loguru") from None
  return Eagle3DraftModel, Eagle3SpeculatorConfig
