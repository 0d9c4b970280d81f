"""What the hooks remember, in one object (:data:`STATE`), instead of attributes on DeepSpeed's objects.

* per ``zero.Init`` object (weakly keyed: it goes when the Init goes): its :class:`InitState`;
* while a ZeRO optimizer is constructed under an engine: that engine's settings (a context variable,
  so other threads and later engines are not affected), and whether the accelerator reports
  unbounded free memory;
* the DeepSpeed functions :mod:`.install` replaced, to put them back, and the adapters it chose for the
  installed DeepSpeed's variant of each internal (:mod:`.variants`).
"""
from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any

from ztriton.integrations.deepspeed.config import Settings
from ztriton.policy import Options

__all__ = ["InitState", "STATE"]


@dataclass
class InitState:
    """One ``zero.Init``: its settings, its options once resolved (staging chunk and host-init size are
    picked once per Init: probing free memory per module would cost a query each), and its progress."""

    settings: Settings
    # Whether this Init partitions through ztriton: None until decided (and the "partitions through ztriton" /
    # "falls back" line logged), once DeepSpeed's __init__ has fixed its settings.
    uses_ztriton: bool | None = None
    options: Options | None = None  # settings.options with sharded_init_bytes resolved (chunk_bytes at the first partition)
    worlds: dict = field(default_factory=dict)  # id(process group) -> its ztriton.comm.World, asked once
    done_bytes: int = 0
    done_params: int = 0
    sharded_params: int = 0  # of done_params: initialised shard by shard (exact sharded init)
    entered: float | None = None  # perf_counter() when its context was entered (the summary's time)
    launched: int = 0  # this thread's kernel launches when its context was entered (the summary's count)
    told_unwatchable: bool = False  # the "created in full: the recorder cannot watch it" line was logged
    recorder: Any = None  # the sharded_init.Recorder while its constructors are patched (the top-level Init's)


@dataclass
class HookState:
    inits: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # Settings of the engine whose ZeRO optimizer is being constructed (None outside that construction).
    building_optimizer: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("ztriton_optimizer", default=None))
    # The ZeRO-1/2 optimizer whose init-time flatten goes through ztriton, with its settings and the list of
    # its groups' summary lines, said once it is built.
    flattening: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("ztriton_flattening", default=None))
    spoof_free_memory: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("ztriton_spoof_memory", default=False))
    # (owner, name) -> (DeepSpeed's function, whether owner itself defined it rather than a base class).
    originals: dict[tuple[Any, str], tuple[Any, bool]] = field(default_factory=dict)
    # The same for the one hook left where ztriton stands aside from DeepSpeed (it only reads the key).
    key_reader: dict[tuple[Any, str], tuple[Any, bool]] = field(default_factory=dict)
    # The installed DeepSpeed's variants (a variants.Variants), set at install before any hook can run.
    variants: Any = None

    def init(self, init) -> InitState | None:
        """The state of a ``zero.Init`` object, None if it was not made while the hooks were installed."""
        return self.inits.get(init)


STATE = HookState()
