"""What the user sees when the key takes effect: lines in DeepSpeed's own log, and progress bars.

* :func:`banner` -- one line when ``"partition_backend": "triton"`` takes effect somewhere (once per
  process and message), :func:`step_summary` -- one line per step (what moved, tier, bytes, time,
  peak; :func:`summary_later` for a step timed on the device's stream, said once its caller is done),
  :func:`warn_once` -- a warning about the config, once per process and message.
* :func:`progress` -- a tqdm bar for long work (a loader over many GiB, host tiers).

Every line goes to rank 0 only, through DeepSpeed's logger (``deepspeed.utils.logger``, its
``[date] [INFO] [file:line:function]`` format on stdout), so ztriton's lines sit among DeepSpeed's
own. DeepSpeed 0.19.8 sets that logger to WARNING unless the config has ``"log_level"``; a user who
turned the key on should still see that it ran, so banners and summaries are INFO records handed to
DeepSpeed's handlers whenever the logger shows warnings (its default), and are silenced with it
(``"log_level": "error"``, or ``logging.getLogger("DeepSpeed").setLevel(logging.ERROR)``).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable

from ztriton.memory import format_bytes, measure_peak
from ztriton.progress import Bar, bar

__all__ = ["StreamClock", "banner", "format_seconds", "launch_count", "progress", "step_summary", "summary_later", "timed",
           "timed_on_stream", "warn_once"]

_said: set[str] = set()  # banners and warnings already logged by this process
# Kernel launches per step (this thread's): the count at this thread's last summary line, and a timed step's own.
_steps = threading.local()


def launch_count() -> int:
    """This thread's kernel launches so far (``ztriton.kernels.state``; importing it imports no triton): read at a
    step's start, the step's are the difference at its end."""
    from ztriton.kernels import state

    return state.thread_launches()


def _route(launches: int | None) -> str:
    """The summary's route field: ``route=triton, launches=N`` where kernels ran, ``route=torch`` otherwise."""
    if launches is None:
        at = getattr(_steps, "last_line", 0)
        launches = launch_count() - at
    return f"route=triton, launches={launches}" if launches > 0 else "route=torch"


def _is_rank0() -> bool:
    """Rank 0 of the world; before torch.distributed is initialised, the launcher's ``RANK`` says (every
    launcher sets it: deepspeed, torchrun, accelerate launch), and a process without one is rank 0."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _deepspeed_logger() -> logging.Logger:
    from deepspeed.utils import logger

    return logger


def _caller(stacklevel: int) -> tuple[str, int, str]:
    """The file, line and function ``stacklevel`` frames above the caller: where a line says it comes from."""
    frame = sys._getframe(stacklevel + 1)
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _emit(level: int, message: str, stacklevel: int, where: tuple[str, int, str] | None = None) -> None:
    """Hand ``message`` to DeepSpeed's logger's handlers as a record at ``level``, attributed to the
    caller ``stacklevel`` frames up (so the line names the ztriton function that did the work), or to
    ``where`` (:func:`_caller`'s, kept for a line said later). The ``ztriton`` logger gets it too
    (marked ``ztriton_report``), so that its log is complete."""
    where = where or _caller(stacklevel)
    ztriton_logger = logging.getLogger("ztriton")
    if ztriton_logger.isEnabledFor(level):
        ztriton_logger.handle(ztriton_logger.makeRecord(ztriton_logger.name, level, *where[:2], message, (), None,
                                                        where[2], extra={"ztriton_report": True}))
    logger = _deepspeed_logger()
    if not logger.isEnabledFor(max(level, logging.WARNING)):
        return  # the user silenced DeepSpeed (and with it, us)
    record = logger.makeRecord(logger.name, level, where[0], where[1], message, (), None, where[2])
    if level >= logger.getEffectiveLevel() or not logger.handlers:
        logger.handle(record)
    else:  # DeepSpeed's default level (WARNING) hides INFO records: its handlers show ours all the same
        for handler in logger.handlers:
            handler.handle(record)


def banner(message: str) -> None:
    """One INFO line on rank 0, once per process: the key took effect (``message`` says where)."""
    if message in _said or not _is_rank0():
        return
    _said.add(message)
    _emit(logging.INFO, f"ztriton: {message}", stacklevel=2)


def warn_once(message: str) -> None:
    """One WARNING line on rank 0, once per process (a config that looks wrong: every rank has it)."""
    if message in _said or not _is_rank0():
        return
    _said.add(message)
    _emit(logging.WARNING, f"ztriton: {message}", stacklevel=2)


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def step_summary(step: str, *, tier: str | None, nbytes: int, seconds: float | None, peak_bytes: int | None,
                 where: tuple[str, int, str] | None = None, launches: int | None = None, **extra: Any) -> str:
    """One INFO line on rank 0 for one step of work: what moved (``step``), the tier or path it took, how
    many bytes, how long (None: not known), the peak device memory above the step's start (None: not measured,
    e.g. on the CPU), the route (``route=triton, launches=N`` or ``route=torch``), then ``extra`` as
    ``key=value``. Returns the line (also off rank 0), for callers that keep it. The line names its caller as where
    it comes from, or ``where`` (a line said later: :func:`summary_later`).

    ``launches``: the step's kernel launches; by default those of the last :func:`timed` step on this thread,
    else every launch since this thread's previous line."""
    tier = getattr(tier, "value", tier)  # an enum (ztriton.policy.Tier) reads as its name
    rate = f" ({nbytes / seconds / 1e9:.2f} GB/s)" if seconds and nbytes else ""
    took = "n/a" if seconds is None else format_seconds(seconds)
    peak = "n/a" if peak_bytes is None else format_bytes(peak_bytes)
    route = _route(getattr(_steps, "timed", None) if launches is None else launches)
    _steps.timed, _steps.last_line = None, launch_count()
    details = "".join(f", {key}={value}" for key, value in extra.items())
    line = (f"ztriton: {step}: tier={tier or 'none'}, {format_bytes(nbytes)} in {took}{rate}, "
            f"peak device {peak}, {route}{details}")
    if _is_rank0():
        _emit(logging.INFO, line, stacklevel=2, where=where)
    return line


def summary_later(step: str, clock: StreamClock, **fields: Any) -> Callable[[], None]:
    """:func:`step_summary` of a step whose device work may still be running: the line, attributed to the
    caller, is said when the returned function is called, with the seconds ``clock`` then reads. Called from a
    ``finally``, it raises nothing (a failing log handler is reported at debug level): a log line must not
    replace the caller's own exception, nor fail a step that succeeded."""
    where = _caller(1)

    def say() -> None:
        try:
            step_summary(step, seconds=clock.seconds(), where=where, launches=clock.launches, **fields)
        except Exception as exc:  # noqa: BLE001 -- see the docstring
            logging.getLogger("ztriton").debug("ztriton: the line of %r could not be logged (%s)", step, exc)

    return say


def timed(work: Callable[[], Any]) -> tuple[Any, float, int | None]:
    """``work()``, its wall seconds (device synchronised) and the peak device memory it added above what
    was allocated at its start (None without CUDA: not measured). Peak statistics are reset, as DeepSpeed's
    own ``see_memory_usage`` resets them between its steps. The kernel launches it issued go to the next
    :func:`step_summary` on this thread."""
    import torch

    before = launch_count()
    out, seconds, peak = measure_peak(work)
    _steps.timed = launch_count() - before
    return out, seconds, peak if torch.cuda.is_available() else None


class StreamClock:
    """How long work took, read without making the host wait for the device: an event before and one after the
    work on the device's current stream, :meth:`seconds` waiting only when asked (by then the work is long done,
    in its caller's next steps). The seconds are the longer of the host's (the call) and the events' (from
    where the stream reached the work to its last copy): the events alone would leave out the host's share when
    earlier work kept the stream busy. Without CUDA the host's; None where the events cannot be read (a device
    error since: its own exception says so)."""

    def __init__(self, device):
        import torch

        self._events = None
        if device.type == "cuda" and torch.cuda.is_available():
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(torch.cuda.current_stream(device))
            self._device = device
        self._start, self._host = time.perf_counter(), None
        self._launched_before, self.launches = launch_count(), None

    def stop(self) -> None:
        import torch

        self._host = time.perf_counter() - self._start
        self.launches = launch_count() - self._launched_before  # kernel launches issued by the work
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self._device))

    def seconds(self) -> float | None:
        if self._events is None:
            return self._host
        try:
            self._events[1].synchronize()
            return max(self._host, self._events[0].elapsed_time(self._events[1]) / 1e3)
        except RuntimeError:
            return None


def timed_on_stream(work: Callable[[], Any], device) -> tuple[Any, StreamClock, int | None]:
    """``work()``, a :class:`StreamClock` of it on ``device`` and the peak device memory it added, all without
    synchronising: a caller that goes on with more host work lets the device's copies run under it, as
    DeepSpeed's own ``torch.cat`` does."""
    import torch

    clock = StreamClock(device)
    out, _, peak = measure_peak(work, synchronize=False)
    clock.stop()
    return out, clock, peak if torch.cuda.is_available() else None


def progress(total_bytes: int, desc: str, *, force: bool | None = None) -> Bar:
    """A bar over ``total_bytes`` on rank 0: ``with progress(n, "loading") as bar: bar.update(k)``; shown
    under :mod:`ztriton.progress`'s rule (a terminal, or ``force`` / ``ZTRITON_PROGRESS``)."""
    return bar(total_bytes, f"ztriton: {desc}", wanted=_is_rank0(), force=force)
