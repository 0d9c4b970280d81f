"""Idle timers of the process's staging memory: each frees memory left unused for a while, and the
interpreter's exit stops them all."""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

__all__ = ["DEFAULT_IDLE_S", "start_idle_timer", "stop_timers_at_exit"]

# Seconds staging memory may sit unused before it is freed: long enough to survive the gap between two
# loads of one start-up, short enough not to hold gigabytes of pinned memory through training.
DEFAULT_IDLE_S = 30.0

# Every idle timer armed (rings and the spill pool), for the interpreter's exit to stop.
_TIMERS: "weakref.WeakSet[threading.Timer]" = weakref.WeakSet()
# At exit, wait at most this long for a timer already freeing (unregistering pinned memory takes milliseconds).
_EXIT_WAIT_S = 10.0


def start_idle_timer(delay: float, callback) -> threading.Timer:
    """A started daemon timer calling ``callback(timer)`` after ``delay`` seconds, known to the exit's stop."""
    timer = threading.Timer(delay, callback)
    timer.args = (timer,)
    timer.name = "ztriton-staging-idle"
    timer.daemon = True
    _TIMERS.add(timer)
    timer.start()
    return timer


def stop_timers_at_exit() -> None:
    """At interpreter exit: cancel the idle timers, and wait for one already freeing memory. The timers are
    daemon threads; one still inside CUDA (``cudaHostUnregister``, an event's wait) when the interpreter
    finalises is stopped where it stands, and a thread stopped inside C++ code can abort the whole process
    ("FATAL: exception not rethrown") after the user's script has finished. The memory itself is the
    process's to drop at exit. A cancelled timer that has not fired ends at once."""
    timers = [t for t in list(_TIMERS) if t is not threading.current_thread()]
    for timer in timers:
        timer.cancel()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for timer in timers:
        if timer.is_alive():
            timer.join(timeout=max(0.0, deadline - time.monotonic()))


atexit.register(stop_timers_at_exit)


def _forget_timers_in_forked_child() -> None:
    _TIMERS.clear()  # the parent's timers: no thread here, nothing for the child's exit to cancel


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_timers_in_forked_child)
