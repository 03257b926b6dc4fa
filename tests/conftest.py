"""Every test runs on 8 simulated CPU devices; this must happen before JAX is imported.

The devices are simulated the way `distillax --devices 8` does it (distillax.main, which imports
no JAX), so the suite also gets its patient collectives: 8 devices on a loaded 2-core machine
must not abort on XLA:CPU's default collective deadline.

Compiling is most of the suite's time, and many tests compile the same programs (the tiny
configs' train steps, in this process, in CLI and benchmark subprocesses, in the other xdist
worker). JAX's persistent compilation cache in one directory per test session, which every
process of the session inherits through the environment, compiles each of them once. The
directory starts empty and is removed at the end, so no run depends on an earlier one.

The tests check numbers and shapes, never speed, so XLA:CPU compiles them with LLVM's cheap
pipeline (`--xla_backend_optimization_level=0`, expensive passes off): measured here, it cut
tests/framework/test_backends.py from 79.5 s to 51.9 s and its CPU time from 122 s to 68 s,
which is what a busy machine runs short of. XLA:CPU's elemental kernel emitters
(`--xla_cpu_use_fusion_emitters=false`, instead of the newer MLIR fusion emitters) compile
faster still: test_backends.py's CPU time went from 75.8 s to 53.8 s, with the same losses to
the last printed digit. They expand a scatter into a while loop and order a few sums otherwise,
so the two tests whose claim is about the exact program a user's XLA:CPU builds (an HLO trip
count, a gradient equal to 1e-6) compile theirs with the default emitters
(tests/support/xla.py). XLA:CPU also splits each program's LLVM module into 32 parts it
compiles on a thread pool (`--xla_cpu_parallel_codegen_split_count`); on 2 cores that two test
processes already keep busy the parts only add work, so the suite compiles each program as one
(the same code; tests/support/xla.py's full compile keeps the 32): measured on six heavy files
(test_configs, test_backends, test_qat_schedule, test_saved, test_moe, test_qat_bench; 2
workers), XLA's compile time went from 144.6 and 148.9 s to 126.7 and 129.9 s, their pytest time
from 125.4 and 130.4 s to 117.7 and 119.5 s. Only the jaxlib line these were measured on gets
these two flags (an XLA that no longer knows a flag aborts at start). The benchmarks measure speed in their own processes
and are run by tests only as smoke tests of their figures' bookkeeping. A user's own XLA_FLAGS
win.
"""

import atexit
import importlib.metadata
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The chip run (scripts/chip_tests.sh --tpu) sets JAX_PLATFORMS=tpu,cpu: JAX then runs on the
# TPU as a user's program does, without what follows for a CPU host (libtpu's settings for
# compiling off a TPU VM, XLA:CPU's cheap compile flags, the simulated devices).
_ON_CPU = os.environ["JAX_PLATFORMS"].split(",")[0] in ("", "cpu")
if _ON_CPU:
  # `plan --target` tests load libtpu (compile-only TPU devices) in both xdist workers: libtpu
  # takes a lock file per process unless told that several may load it; off a TPU VM it should
  # ask no metadata server and look for no workers (distillax/cli/target_env.py sets the same).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # The reference libraries' own thread pools (torch's OpenMP and MKL, numpy's OpenBLAS) get one
  # thread each, here and in every child process: with two test processes on two cores, their
  # second thread only competes with the other process (measured: tests/models/hf, 2 workers,
  # back to back on the shared machine: 54.8-58.3 s -> 49.3-52.4 s, CPU 100-107 s -> 90-95 s).
  # The same tests and results; a user's own setting wins.
  for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
  try:  # numpy's OpenBLAS is loaded already (a pytest plugin imports numpy): limit it in place
    import threadpoolctl  # scikit-learn's dependency (the eval extra); without it, as before
  except ImportError:
    pass
  else:
    threadpoolctl.threadpool_limits(int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set by the xdist controller for its workers
  _cache_dir = tempfile.mkdtemp(prefix="distillax-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Files jobs cache outside their workdir (data/corpus_bpe.py's tokenizers) go to a directory of
# this session too, not the user's ~/.cache: every test session trains them anew, as CI does.
if "DISTILLAX_CACHE" not in os.environ:
  _distillax_cache = tempfile.mkdtemp(prefix="distillax-test-cache-")
  os.environ["DISTILLAX_CACHE"] = _distillax_cache
  atexit.register(shutil.rmtree, _distillax_cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
_CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
if importlib.metadata.version("jaxlib").startswith("0.10."):
  _CHEAP_COMPILE += ("--xla_cpu_use_fusion_emitters=false",
                     "--xla_cpu_parallel_codegen_split_count=1")
if not _ON_CPU:
  _CHEAP_COMPILE = ()
_xla_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_xla_flags + [
    f for f in _CHEAP_COMPILE if f.split("=")[0] not in {x.split("=")[0] for x in _xla_flags}])

from distillax.main import _preset_devices  # noqa: E402

assert not _ON_CPU or _preset_devices(["--devices=8"]) is None

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """The heaviest files first (tests/support/schedule.py says why)."""
  from tests.support.schedule import heaviest_first
  heaviest_first(items)
