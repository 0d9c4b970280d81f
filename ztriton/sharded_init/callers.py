"""Where a placeholder was asked for, and which init function met an op it cannot record: the places the
recorder's log lines name."""
from __future__ import annotations

import os
import sys

# Frames of these are not the caller's: ztriton's own package and, by path, torch's and DeepSpeed's.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THEIRS = (os.sep + "torch" + os.sep, os.sep + "deepspeed" + os.sep)


def origin() -> str:
    """The first frame outside torch and ztriton: where the caller asked for the tensor."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_OURS) or _THEIRS[0] in path or _THEIRS[1] in path):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def caller_context() -> str:
    """For a fallback's log line: the init function being run, if any, and the caller's place."""
    frame, init_fn = sys._getframe(1), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in ("torch.nn.init", "transformers.initialization") and not frame.f_code.co_name.startswith("_"):
            init_fn = f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    place = origin()
    return ", ".join(p for p in (f"in {init_fn}" if init_fn else "", f"at {place}" if place else "") if p)
