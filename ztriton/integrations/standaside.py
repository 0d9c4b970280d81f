"""Where ztriton stands aside, and the one line that says so.

An integration whose library's internals are not the ones ztriton knows (a release that moved them) installs
none of its hooks and records why here. Nothing is said at import: most processes never ask for ztriton. The
first DeepSpeed config with ``"partition_backend": "triton"`` that the process reads says it, once, on rank 0
(:func:`announce`, called from the config hook, or from the stand-in hook that reads only the key where
DeepSpeed's own hooks stood aside).
"""
from __future__ import annotations

import logging

__all__ = ["REASONS", "announce", "stand_aside"]

logger = logging.getLogger("ztriton")

# library -> why ztriton stands aside from it in this process (its hooks are not installed)
REASONS: dict[str, str] = {}


def stand_aside(library: str, reason: str) -> None:
    REASONS[library] = reason
    logger.debug("ztriton: standing aside from %s: %s", library, reason)


def announce() -> None:
    """A config with the key was read: say, once per library on rank 0, which library ztriton stands aside from."""
    if not REASONS:
        return
    from ztriton.integrations.deepspeed.report import warn_once

    for library, reason in sorted(REASONS.items()):
        warn_once(f"\"partition_backend\": \"triton\" has no effect on {library} in this process: {reason}. "
                  f"{library}'s own code runs instead, exactly as without the key (supported versions: README)")
