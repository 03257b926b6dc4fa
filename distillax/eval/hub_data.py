"""Whether the data sets of `eval --tasks` can be read here, decided before lm-eval starts.

A task whose data set is on the Hugging Face Hub (hellaswag's Rowan/hellaswag, a YAML's
`dataset_path: org/name`) is downloaded by `datasets` when lm-eval builds the task. Offline, and
with nothing in the cache, the Hub client retries each request with backoff (1, 2, 4, 8, 8 s),
printing each retry, before the error: half a minute of noise for a line distillax could say
at once. So, first: every such data set found in neither the Hub cache nor `datasets`' own is
looked for on the Hub, and when the Hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) or cannot
be reached (one connection to HF_ENDPOINT, a few seconds at most; not tried behind a proxy, which
the client would use), the command stops with one line naming the task, its data set and the
offline route (a task YAML over local JSON). Data that is cached, local files and `datasets`'
own builders (json, csv, parquet...) are left to lm-eval.
"""

from __future__ import annotations

import os
import socket
from typing import Iterator
from urllib.parse import urlparse

from distillax.errors import UserError

# `dataset_path` values that name a `datasets` builder over local files, not a Hub repository.
_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml", "sql", "generator",
             "webdataset", "imagefolder", "audiofolder", "videofolder")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
               "all_proxy")
PROBE_SECONDS = 3.0  # how long the one connection to the Hub may take


def _task_datasets(spec, manager, seen: set) -> Iterator[tuple[str, str]]:
  """(task name, dataset_path) of each task under `spec`: a task config, or a task, group or
  tag name of lm-eval's index."""
  if isinstance(spec, dict):
    if spec.get("dataset_path"):
      yield str(spec.get("task", "?")), str(spec["dataset_path"])
    for member in spec.get("task", ()) if isinstance(spec.get("task"), list) else ():
      yield from _task_datasets(member, manager, seen)
    return
  if not isinstance(spec, str) or spec in seen:
    return
  seen.add(spec)
  index = manager.task_index if manager is not None else {}
  entry = index.get(spec)
  if entry is not None and entry.cfg is not None:
    yield from _task_datasets(entry.cfg, manager, seen)
  elif entry is not None:  # a tag: every task that carries it
    for name, other in index.items():
      if spec in (other.tags or ()):
        yield from _task_datasets(name, manager, seen)


def _is_hub_repo(path: str) -> bool:
  return path not in _BUILDERS and "://" not in path and not os.path.exists(path)


def _cached(repo: str) -> bool:
  """Whether a snapshot of dataset `repo` is in the Hub cache, or `datasets` prepared it."""
  import datasets
  from huggingface_hub import snapshot_download
  if os.path.isdir(os.path.join(str(datasets.config.HF_DATASETS_CACHE),
                                repo.replace("/", "___"))):
    return True
  try:
    snapshot_download(repo_id=repo, repo_type="dataset", local_files_only=True)
    return True
  except Exception:  # noqa: BLE001 - not cached, or not a valid repository id: not here
    return False


def hub_unreachable() -> str | None:
  """Why the Hub cannot serve a download from here, or None when it may (or a proxy decides)."""
  for var in _OFFLINE_VARS:
    if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
      return f"{var}={os.environ[var]} keeps the Hub client offline"
  if any(os.environ.get(var) for var in _PROXY_VARS):
    return None
  endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
  url = urlparse(endpoint)
  host, port = url.hostname or endpoint, url.port or (80 if url.scheme == "http" else 443)
  try:
    socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
  except OSError as e:
    return f"the Hub ({endpoint}) cannot be reached from here ({e.strerror or e})"
  return None


def _named(by_repo: dict[str, list[str]]) -> str:
  """'cais/mmlu (task mmlu_anatomy and 56 more)', for each data set."""
  def tasks(names):
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"task {names[0]}{more}"
  return ", ".join(f"{repo} ({tasks(names)})" for repo, names in by_repo.items())


def check_task_data(tasks: str, specs: list, manager) -> None:
  """Refuses, in one line, tasks whose Hub data set is not cached while the Hub is
  unreachable; returns quietly otherwise (lm-eval then loads or downloads it)."""
  by_repo: dict[str, list[str]] = {}
  for spec in specs:
    for task, path in _task_datasets(spec, manager, set()):
      if _is_hub_repo(path):
        by_repo.setdefault(path, []).append(task)
  missing = {repo: names for repo, names in by_repo.items() if not _cached(repo)}
  if not missing:
    return
  why = hub_unreachable()
  if why is None:
    return
  many = len(missing) > 1
  raise UserError(f"--tasks={tasks}: the Hugging Face data set{'s' if many else ''} "
                  f"{_named(missing)} {'are' if many else 'is'} not in this machine's cache, "
                  f"and {why}; download {'them' if many else 'it'} where the Hub is reachable "
                  f"(the same HF_HOME), or give a task YAML over a local JSON file "
                  f"(dataset_path: json, dataset_kwargs.data_files)")
