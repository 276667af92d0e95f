"""One run per output folder: a ``flock`` on ``<folder>/.bytescale.lock`` (one machine: the demo),
and ``HeartbeatLock`` (a lock file with the job's identity and a heartbeat: a Megatron run's
``--save`` folder on a filesystem several nodes share).

The launcher holds an exclusive lock for the whole run; each worker holds a shared lock on
``<folder>/.bytescale-ranks.lock`` while it runs. A new run takes the first and then checks it
could take the second exclusively: so it refuses to start while the previous launcher *or any
of its workers* is alive. The kernel drops a lock when its holder dies, so a killed run never
leaves a stale lock behind. The lock file records the holder's PID for the message.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

from .errors import ConfigError

RUN_LOCK = ".bytescale.lock"
RANKS_LOCK = ".bytescale-ranks.lock"


class FolderLock:
    def __init__(self, folder: str | Path, what: str = "run"):
        self.folder, self.what = Path(folder), what
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only filesystem or folder, a full disk, a file in the way
            raise ConfigError(
                f"--out {self.folder}: cannot write there ({exc.strerror or exc}); choose a writable --out"
            ) from None
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


# ------------------------------------------------------------------ across nodes
SAVE_LOCK = ".bytescale-save.lock"
HEARTBEAT_S = float(os.environ.get("BYTESCALE_LOCK_HEARTBEAT_S", "10"))
# A lock whose holder has not beaten for this long is stale. Several heartbeats, so a slow shared
# filesystem or a busy node does not lose a live run its lock; tests shorten it.
STALE_AFTER_S = float(os.environ.get("BYTESCALE_LOCK_STALE_S", "60"))


def job_identity() -> dict:
    """Who holds a lock: host, PID, the scheduler's job ID when there is one, and when it started."""
    import socket

    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "started": time.time()}


def describe(holder: dict) -> str:
    job = f"job {holder['job']}, " if holder.get("job") else ""
    return f"{job}pid {holder.get('pid', '?')} on {holder.get('host', '?')}"


class HeartbeatLock:
    """One writer per folder on a filesystem shared by several nodes: ``<folder>/.bytescale-save.lock``.

    ``flock`` is not enough here: on NFS and Lustre it is either node-local or depends on mount
    options, and a lock held by a node that crashed may never be released. Instead the lock is a
    file created with ``O_CREAT | O_EXCL`` (atomic on local filesystems, NFSv3+ and Lustre) that
    records the holder's host, PID, job ID and start time; a thread of the holder rewrites its
    modification time every ``HEARTBEAT_S``. A lock is stale when its holder is a dead process on
    this host, or when nobody has beaten for ``STALE_AFTER_S``; a new run then takes it over by
    renaming the stale file aside (``rename`` is atomic: of two runs taking over at once, one
    wins) and creating its own. Only the mtime is compared, on the file server's clock, so the
    nodes' clocks need not agree.
    """

    def __init__(self, folder: str | Path, what: str = "run", flag: str = "--save"):
        self.folder, self.what, self.flag = Path(folder), what, flag
        self.path = self.folder / SAVE_LOCK
        self.took_over: str | None = None  # who held the stale lock we replaced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _holder(self) -> tuple[dict, float] | None:
        """(identity, seconds since its last heartbeat) of the current holder, or None."""
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            holder = json.loads(text)
        except ValueError:  # written half-way: the holder died between create and write
            holder = {}
        return (holder if isinstance(holder, dict) else {}), age

    def _stale(self, holder: dict, age: float) -> str | None:
        """Why ``holder`` no longer holds the lock, or None while it does."""
        import socket

        from .process_lifetime import _alive

        if (
            holder.get("host") == socket.gethostname()
            and isinstance(holder.get("pid"), int)
            and not _alive(holder["pid"])
        ):
            return "its process is gone"
        # an elastic restart (torchrun's agents restarted every rank after a node died): the
        # holder was this job's previous round, whose rank 0 may have been on the lost node,
        # where no heartbeat can stop for another minute
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart not in ("", "0") and holder.get("job") and holder.get("job") == job_identity()["job"]:
            return f"it was this job's round before elastic restart {restart}"
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _refuse(self, holder: dict, age: float) -> ConfigError:
        return ConfigError(
            f"{self.flag} {self.folder} is in use by another {self.what} "
            f"({describe(holder)}, heartbeat {age:.0f} s ago); "
            f"stop it, wait for it to finish, or choose another {self.flag} (a lock without heartbeat for "
            f"{STALE_AFTER_S:.0f} s is taken over)"
        )

    def check_free(self) -> None:
        """ConfigError if a live run holds the lock (a stale one does not count): the launcher's early look."""
        found = self._holder()
        if found is not None and self._stale(*found) is None:
            raise self._refuse(*found)

    def _unwritable(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"{self.flag} {self.folder}: cannot write there ({exc.strerror or exc}); make it writable, free space, "
            f"or choose another {self.flag}"
        )

    def check_writable(self) -> None:
        """ConfigError unless a file can be created, written and synced in the folder (created if
        missing): the launcher's look, before the ranks start. What it writes, it removes."""
        probe = self.folder / f".bytescale-write-probe-{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, bytes(4096))  # a whole block: a full disk refuses it (an empty file needs none)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._unwritable(exc) from None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass

    def acquire(self) -> HeartbeatLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._unwritable(exc) from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                if not isinstance(exc, FileExistsError):
                    raise self._unwritable(exc) from None
                found = self._holder()
                if found is None:
                    continue  # released meanwhile
                why = self._stale(*found)
                if why is None:
                    raise self._refuse(*found) from None
                aside = self.path.with_name(f"{SAVE_LOCK}.stale-{os.getpid()}")
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue  # another run took it over first; try again (it will refuse us)
                os.unlink(aside)
                self.took_over = f"{describe(found[0])}: {why}"
                continue
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(job_identity(), f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:  # a full disk: no empty lock left behind for the next run to puzzle over
                self.path.unlink(missing_ok=True)
                raise self._unwritable(exc) from None
            self._thread = threading.Thread(target=self._beat, name="save-lock-heartbeat", daemon=True)
            self._thread.start()
            return self
        raise ConfigError(
            f"{self.flag} {self.folder}: could not take {self.path} (other runs kept taking it); try again"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # the folder went away; the run's own saves will report it
                pass

    def release(self) -> None:
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == job_identity()["host"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> HeartbeatLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
