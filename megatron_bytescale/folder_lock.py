"""One run per output folder: a ``flock`` on ``<folder>/.bytescale.lock``.

The launcher holds an exclusive lock for the whole run; each worker holds a shared lock on
``<folder>/.bytescale-ranks.lock`` while it runs. A new run takes the first and then checks it
could take the second exclusively: so it refuses to start while the previous launcher *or any
of its workers* is alive. The kernel drops a lock when its holder dies, so a killed run never
leaves a stale lock behind. The lock file records the holder's PID for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import ConfigError

RUN_LOCK = ".bytescale.lock"
RANKS_LOCK = ".bytescale-ranks.lock"


class FolderLock:
    def __init__(self, folder: str | Path, what: str = "run"):
        self.folder, self.what = Path(folder), what
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"another {self.what} (pid {holder}) is using {self.folder}; wait for it to finish, stop it, "
                f"or choose another --out"
            ) from None
        ranks = os.open(self.folder / RANKS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(ranks, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"processes of a previous {self.what} on {self.folder} are still running; stop them "
                f"(see `fuser {self.folder / RANKS_LOCK}`) or choose another --out"
            ) from None
        finally:
            os.close(ranks)  # closing drops our probe lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def hold_as_worker(folder: str | Path) -> int:
    """In a worker: hold the shared worker lock of ``folder`` until this process exits (returns the fd)."""
    fd = os.open(Path(folder) / RANKS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd
