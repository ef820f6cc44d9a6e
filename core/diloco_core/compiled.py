"""Loops compiled to machine code (numba) beside the numpy code they equal bit for bit, for the few
places where numpy makes several passes over an array the size of a model's fragment: compiled in
the background, and never on the way of a request.

A loop is asked for by its :class:`Loop` (its key, how to build it, and arguments of the exact types
its callers pass). The first call over at least ``WORTH_COMPILING`` values that asks for it
has it compiled by one background thread (which imports numba first, once per process: about 0.2 s
and 125 MB of resident memory) for that one signature, and runs its numpy code meanwhile, as every
call does until the loop is ready. A compiled loop then takes no other signature
(``disable_compile``): it cannot compile on a call. A process that never handles so many values at
once never loads numba; without numba installed (the learner's image does not carry it), or with
``DILOCO_COMPILED_LOOPS=off``, nothing is compiled and the numpy code always runs. The loops run
without the GIL, and floating-point arithmetic is neither reordered nor contracted (``fastmath``
off): a loop rounds as numpy does when it applies the same operations in the same order. Only a
NaN's payload may differ where an operation meets two NaNs (docs/internals.md).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

log = logging.getLogger(__name__)

WORTH_COMPILING = 1 << 20
"""Values in one call that ask for a loop to be compiled (smaller calls use one already compiled)."""
ENABLED = os.environ.get("DILOCO_COMPILED_LOOPS", "on").strip().lower() not in ("off", "0", "false", "no")


@dataclass(frozen=True)
class Loop:
    """A loop: ``key`` names it (one compiled loop per key in a process), ``build(njit)`` returns the
    numba function (``njit``: numba's, without the GIL), and ``sample()`` gives arguments of the types
    every call gives it."""

    key: Hashable
    build: Callable[[Callable[..., Any]], Any]
    sample: Callable[[], tuple[Any, ...]]


def read_only(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``a``, or a view of it, that refuses writes: how a loop takes the arrays it only reads, so
    that every call has the types it was compiled for, whether the caller's arrays are writable."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


_ready: dict[Hashable, Any] = {}
_asked: set[Hashable] = set()
_lock = threading.Lock()  # what is asked for; never held while numba is imported or a loop compiles
_import_lock = threading.Lock()  # numba's import, once
_work: queue.SimpleQueue[Loop] = queue.SimpleQueue()
_thread: list[threading.Thread] = []  # the compiling thread, once started
_njits: list[Callable[..., Any] | None] = []  # numba's njit once loaded (None: numba is not installed)


def loop(spec: Loop, values: int) -> Any | None:
    """The compiled loop of ``spec`` when it is ready, else None (the caller runs its numpy code); a
    call over ``values >= WORTH_COMPILING`` values has it compiled in the background first."""
    found = _ready.get(spec.key)
    if found is not None or not ENABLED or values < WORTH_COMPILING:
        return found
    with _lock:
        if spec.key in _asked:
            return None
        _asked.add(spec.key)
        _work.put(spec)
        if not _thread:
            _thread.append(threading.Thread(target=_compile_asked, name="compile-loops", daemon=True))
            _thread[0].start()
    return None


def compile_now(spec: Loop) -> Any | None:
    """``spec``'s loop compiled in this thread and ready for :func:`loop` (None without numba or with
    the loops turned off): for a process that wants it before its first large call, and tests."""
    if not ENABLED:
        return None
    with _lock:
        _asked.add(spec.key)
    return _compile(spec)


def _compile_asked() -> None:
    while True:
        _compile(_work.get())


def _compile(spec: Loop) -> Any | None:
    key = spec.key
    found = _ready.get(key)
    if found is not None:
        return found
    njit = _njit()
    if njit is None:
        return None
    started = time.perf_counter()
    try:
        compiled = spec.build(njit)
        compiled(*spec.sample())  # compiles it for the callers' types
        compiled.disable_compile()
    except Exception:  # a loop that does not compile leaves its numpy code in use, as without numba
        log.exception("compiling the loop %r failed; its numpy code is used", key)
        return None
    _ready[key] = compiled
    log.info("compiled loop %r in %.2f s; it is used from now on", key, time.perf_counter() - started)
    return compiled


def _njit() -> Callable[..., Any] | None:
    with _import_lock:  # not ``_lock``: a call asking for another loop meanwhile does not wait for it
        if not _njits:
            try:
                import numba
            except ImportError:
                _njits.append(None)
            except Exception:  # a numba that does not load leaves the numpy code in use, as without it
                log.exception("importing numba failed; the numpy code is used")
                _njits.append(None)
            else:
                _njits.append(lambda **options: numba.njit(nogil=True, **options))
        return _njits[0]
