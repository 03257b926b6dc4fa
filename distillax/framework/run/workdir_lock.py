"""One job at a time in a workdir: an advisory lock on `<workdir>/lock.json`, which also holds
the holder's pid and host so that a refusal can name them.

Two processes that train into one workdir at once corrupt it (issue 55: one crashed inside orbax
and hung, the other's history was lost, and a requeued copy of the same job dropped metric rows
without a word). The lock is an `fcntl.flock` on the file, so the kernel drops it when its holder
dies, however it dies: a crashed holder's lock is taken over. One case outlives the holder: a
child it forked (a data worker, say) inherits the locked file; a record whose pid is gone on this
very host is then stale too, and the lock is taken over on a fresh file. On a filesystem without
flock, the record alone decides (a live pid, or one on another host, holds it).

Only one process of a multi-process job takes it (the trainer asks process 0): the job's other
processes write into the same workdir by design. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket

from distillax.errors import UserError

LOCK_FILE = "lock.json"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _read_record(path: str) -> dict:
  try:
    with open(path) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


def _is_stale(record: dict) -> bool:
  """A record whose pid is gone on this host: its holder died (its lock, if any, is a child's)."""
  pid = record.get("pid")
  return (record.get("host") == socket.gethostname() and isinstance(pid, int)
          and not _pid_alive(pid))


def _same_file(path: str, fd: int) -> bool:
  """Whether `path` still names the file open as `fd`."""
  try:
    return os.stat(path).st_ino == os.fstat(fd).st_ino
  except FileNotFoundError:
    return False


def _held_error(workdir: str, record: dict) -> UserError:
  pid, host = record.get("pid", "unknown"), record.get("host", "unknown")
  return UserError(f"workdir {workdir} is in use by another distillax process (pid {pid} on "
                   f"host {host}); wait for it to end or stop it, or pass a new --workdir "
                   f"(if that process is gone, remove {os.path.join(workdir, LOCK_FILE)})")


class WorkdirLock:
  """The lock on one workdir, held from `acquire` until `release` (or the process's end).

  `acquire` makes the workdir (and its missing parents) when it has to; `release(remove_made=
  True)` removes what it made, when empty, so a job refused before its first step leaves
  nothing behind in a fresh workdir."""

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_FILE)
    self._fd: int | None = None
    self._made: list[str] = []  # folders acquire created, deepest first

  def acquire(self, not_writable) -> None:
    """Takes the lock or raises a UserError naming its holder; `not_writable(workdir, OSError)`
    makes the error for a workdir this process cannot create or write."""
    parent = self.workdir
    while not os.path.exists(parent):
      self._made.append(parent)
      parent = os.path.dirname(parent)
    try:
      os.makedirs(self.workdir, exist_ok=True)
      self._take()
    except OSError as e:
      self._remove_made()
      raise not_writable(self.workdir, e) from None
    except UserError:
      self._remove_made()
      raise

  def _take(self) -> None:
    for _ in range(8):  # another process may replace the file between our open and our flock
      # (again: a multi-process job's other processes probe a new workdir and remove it)
      os.makedirs(self.workdir, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        locked = self._flock(fd)
        if locked is False:
          record = _read_record(self.path)
          if not _is_stale(record):
            raise _held_error(self.workdir, record)
          # A dead holder's child keeps the old file's lock: a fresh file (unless another
          # process replaced it meanwhile, whose file is left alone).
          if _same_file(self.path, fd):
            with contextlib.suppress(FileNotFoundError):
              os.unlink(self.path)
          os.close(fd)
          continue
        if locked is None:  # no flock here: the record alone says who holds it
          record = _read_record(self.path)
          if record and record.get("pid") != os.getpid() and not _is_stale(record):
            raise _held_error(self.workdir, record)
        if not _same_file(self.path, fd):  # unlinked by its releasing holder: again
          os.close(fd)
          continue
      except BaseException:
        if self._fd != fd:
          try:
            os.close(fd)
          except OSError:
            pass
        raise
      self._fd = fd
      self._write_record()
      return
    raise _held_error(self.workdir, _read_record(self.path))

  @staticmethod
  def _flock(fd: int) -> bool | None:
    """True when locked, False when another process holds it, None where flock is unsupported."""
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return True
    except OSError as e:
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return False
      if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
        return None
      raise

  def _write_record(self) -> None:
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n"
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, text.encode(), 0)

  def release(self, *, remove_made: bool = False) -> None:
    """Drops the lock and removes lock.json; with `remove_made`, also the folders acquire made
    (when nothing else is left in them)."""
    if self._fd is None:
      return
    try:
      os.unlink(self.path)  # before unlocking: a waiter then finds the file gone and retries
    except FileNotFoundError:
      pass
    os.close(self._fd)
    self._fd = None
    if remove_made:
      self._remove_made()

  def _remove_made(self) -> None:
    for folder in self._made:  # deepest first; only empty folders
      try:
        os.rmdir(folder)
      except OSError:
        break
    self._made = []
