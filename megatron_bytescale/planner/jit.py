"""The planner's kernels: each hot loop is one plain Python function over numpy arrays, compiled
by numba where numba is installed (it is a dependency).

``@kernel(size=...)`` wraps such a function. A call on a small input (``size(*args)`` below
the kernel's ``small``) runs the function as Python: quick at that size, and it spares a small
job (a CPU run, most tests) the compile. A larger call runs the same function compiled, and
from then on so do the small calls with the same argument types (the compile is paid). There
is one implementation, so both give the same results; the tests run each kernel both ways.
``@jitable`` marks a helper a kernel calls: a plain function in Python, inlined into the
kernels that call it where they are compiled.

Kernels compile once per environment and machine: numba keeps their machine code in its disk
cache (``cache=True``, beside the sources or in a per-user directory), and every compile
happens under a file lock there, so processes that start together (a node's ranks and their
planning processes) wait for one compile instead of each compiling the same kernel; the others
then load it from the cache. A compile that takes more than a moment says so, once per
process, on stderr. ``compile_seconds()`` counts the time spent compiling or waiting for
another process's compile, which ``plan_step`` keeps out of its planning time.

``BYTESCALE_JIT=0`` runs every kernel as Python (as where numba is missing); ``BYTESCALE_JIT=1``
compiles every call, small ones too; ``use(mode)`` sets either for a block (the tests).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MODES = ("auto", "python", "compiled")
_ENV = {"0": "python", "1": "compiled", "": "auto", "auto": "auto", "python": "python", "compiled": "compiled"}
_mode = _ENV.get(os.environ.get("BYTESCALE_JIT", "").strip().lower(), "auto")
_helpers: list[Callable] = []  # every @jitable function, inlined into the kernels that call it
_compiled = [0.0]  # seconds spent compiling (or waiting for another process's compile) in this process
_told = [False]  # the compile line is printed once per process
_lock = threading.Lock()  # one compile at a time in this process
NOTICE_AFTER_S = 1.0  # a compile (not a cache load) takes longer than this: it is announced
# how kernels are compiled (part of what cached code was compiled from: a change here recompiles)
OPTIONS = "njit(cache=True, nogil=True); helpers njit(inline='always')"


def jitable(function: Callable) -> Callable:
    """A helper kernels call: returned as it is (plain Python), compiled into its callers."""
    _helpers.append(function)
    return function


@contextmanager
def use(mode: str):
    """Every kernel in ``mode`` for the block: "python" (uncompiled), "compiled" (every call,
    small ones too) or "auto" (by size)."""
    if mode not in MODES:
        raise ValueError(f"jit mode {mode!r}: choose one of {', '.join(MODES)}")
    global _mode
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before


def mode() -> str:
    return _mode


def compile_seconds() -> float:
    """Seconds this process has spent compiling kernels or waiting for another's compile."""
    return _compiled[0]


def _numba():
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; without it every kernel runs as Python
        return None
    return numba


class Kernel:
    """A kernel: ``function`` run as Python on small inputs, compiled on the others."""

    def __init__(self, function: Callable, size: Callable[..., int], small: int):
        self.function = function
        self.size = size
        self.small = small
        self.__name__ = function.__name__
        self.__doc__ = function.__doc__
        self.__wrapped__ = function
        parameters = inspect.signature(function).parameters.values()
        self._arity = len(parameters)
        self._defaults = function.__defaults__ or ()
        self._dispatcher = None
        self._ready: set[tuple] = set()  # argument kinds (``_kinds``) compiled or loaded in this process

    def __call__(self, *args):
        if len(args) < self._arity:  # defaults passed explicitly: one signature per call site
            args = args + self._defaults[len(args) - self._arity :]
        if _mode == "python":
            return self.function(*args)
        kinds = _kinds(args)
        if kinds in self._ready:  # compiled (or loaded) for these types in this process: small inputs too
            return self._dispatcher(*args)
        if _mode == "auto" and self.size(*args) < self.small:
            return self.function(*args)
        compiled = self.compiled(args)
        return self.function(*args) if compiled is None else compiled(*args)

    def compiled(self, args: tuple):
        """The numba dispatcher, compiled for ``args``' types (None without numba)."""
        kinds = _kinds(args)
        if kinds in self._ready:
            return self._dispatcher
        numba = _numba()
        if numba is None:
            return None
        if self._dispatcher is None:
            self._dispatcher = _dispatcher(numba, self.function)
        _compile(self._dispatcher, tuple(numba.typeof(a) for a in args), self.function)
        self._ready.add(kinds)
        return self._dispatcher


def _kinds(args: tuple) -> tuple:
    """What numba types ``args`` by, cheaply: an array's dtype, dimensions, layout and
    whether it is writable; a tuple's items' kinds; a scalar's Python or numpy type."""
    return tuple(
        (a.dtype.str, a.ndim, a.flags.c_contiguous, a.flags.f_contiguous, a.flags.writeable)
        if isinstance(a, np.ndarray)
        else _kinds(a)
        if isinstance(a, tuple)
        else type(a)
        for a in args
    )


def kernel(size: Callable[..., int] | None = None, small: int = 2048):
    """``Kernel`` of the decorated function; ``size``: the work a call's arguments make (by
    default the first argument's length), compared with ``small``."""

    def wrap(function: Callable) -> Kernel:
        return Kernel(function, size or _first_length, small)

    return wrap


def _first_length(*args) -> int:
    return len(args[0])


def _dispatcher(numba, function: Callable):
    """The kernel compiled by numba: a copy of ``function`` whose globals name each @jitable
    helper as a numba function inlined where it is called (as an inner function would be);
    the module's own names stay the plain functions, which the Python runs call."""
    inlined = _InlinedGlobals(numba)
    compiled_from = inlined.clone(function, jit=False)
    try:
        return numba.njit(cache=True, nogil=True)(compiled_from)
    except RuntimeError:  # no writable cache directory (numba names none): compiled in each process
        return numba.njit(nogil=True)(compiled_from)


class _InlinedGlobals:
    """Copies of functions whose globals name every @jitable helper as ``njit(inline='always')``
    of a copy of it, made the same way (one per helper and per module's globals)."""

    def __init__(self, numba):
        self.numba = numba
        self.helpers = {id(h): h for h in _helpers}
        self.made: dict[int, object] = {}  # helper -> its inlined numba function
        self.spaces: dict[int, dict] = {}  # a module's globals -> the copy the clones read

    def clone(self, function: Callable, jit: bool = True):
        made = self.made.get(id(function))
        if jit and made is not None:
            return made
        space = self._space(function.__globals__)
        copy = types.FunctionType(
            function.__code__, space, function.__name__, function.__defaults__, function.__closure__
        )
        copy.__qualname__, copy.__module__, copy.__doc__ = function.__qualname__, function.__module__, function.__doc__
        if not jit:
            return copy
        made = self.made[id(function)] = self.numba.njit(inline="always")(copy)
        return made

    def _space(self, module_globals: dict) -> dict:
        space = self.spaces.get(id(module_globals))
        if space is None:
            space = self.spaces[id(module_globals)] = dict(module_globals)
            for name, value in module_globals.items():
                if id(value) in self.helpers:
                    space[name] = self.clone(value)
        return space


def _compile(dispatcher, signature: tuple, function: Callable) -> None:
    """``dispatcher.compile(signature)`` (a load where the disk cache has it) under the file
    lock of the cache directory, timed; announced once per process when it takes a while."""
    t0 = time.perf_counter()
    timer = threading.Timer(NOTICE_AFTER_S, _announce)
    timer.daemon = True
    with _lock:
        timer.start()
        try:
            with _file_lock(dispatcher):
                _forget_stale(dispatcher, function)
                dispatcher.compile(signature)
        finally:
            timer.cancel()
            _compiled[0] += time.perf_counter() - t0


def _announce(waiting: bool = False) -> None:
    if _told[0]:
        return
    _told[0] = True
    what = "waiting for another process compiling" if waiting else "compiling"
    from tqdm import tqdm

    # tqdm.write: on its own line above any progress bar (the simulator's), which it redraws after
    tqdm.write(
        f"bytescale: {what} the planner's kernels, once per environment and machine (up to a minute; "
        "later runs load them from numba's cache)",
        file=sys.stderr,
    )
    sys.stderr.flush()


def _cache_path(dispatcher) -> Path | None:
    """The directory numba caches this dispatcher's machine code in (None: no cache)."""
    cache = getattr(dispatcher, "_cache", None)
    path = getattr(cache, "_cache_path", None)
    return Path(path) if path else None


@contextmanager
def _file_lock(dispatcher):
    """An exclusive lock on ``bytescale-kernels.lock`` in the cache directory, held while
    compiling: processes on one machine and environment compile one at a time, and each
    later one finds the kernel in the cache. No lock where there is no cache or no fcntl."""
    path = _cache_path(dispatcher)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        fcntl = None
    if path is None or fcntl is None:
        yield
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle = open(path / "bytescale-kernels.lock", "a+")  # noqa: SIM115 - closed below
    except OSError:  # a cache directory we cannot write: numba compiles without caching
        yield
        return
    with handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process is compiling: say so, then wait for it
            _announce(waiting=True)
            fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def _sources_digest(function: Callable) -> str:
    """SHA-256 of the code the kernel compiles: its own and that of the @jitable helpers it
    calls (directly or through other helpers), as this process loaded them. numba checks only
    the kernel's own source file before it reuses cached code, and the helpers compiled into
    it may live elsewhere."""
    h = hashlib.sha256(OPTIONS.encode())
    for f in [function, *_helpers_used(function)]:
        _hash_code(h, f.__code__)
    return h.hexdigest()[:32]


def _hash_code(h, code) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        if inspect.iscode(c):
            _hash_code(h, c)
        else:
            h.update(repr(c).encode())


def _helpers_used(function: Callable, seen: set[int] | None = None) -> list[Callable]:
    """The @jitable helpers ``function`` names (in its code and its inner functions' code),
    and those they name in turn."""
    seen = set() if seen is None else seen
    helpers = {id(h): h for h in _helpers}
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    out = []
    for name in sorted(names):
        target = function.__globals__.get(name)
        if id(target) in helpers and id(target) not in seen:
            seen.add(id(target))
            out += [target, *_helpers_used(target, seen)]
    return out


def _forget_stale(dispatcher, function: Callable) -> None:
    """Drop this kernel's cached code when the sources it was compiled from changed (kept
    in a stamp file beside the cache, under the lock)."""
    path = _cache_path(dispatcher)
    if path is None:
        return
    digest = _sources_digest(function)
    module = Path(inspect.getsourcefile(function)).stem
    stamp = path / f"{module}.{function.__qualname__}.bytescale-sources"
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return
        for old in path.glob(f"{module}.{function.__qualname__}-*.nb[ic]"):
            old.unlink()
        stamp.write_text(digest)
    except OSError:  # a read-only cache: numba's own check stands
        return
