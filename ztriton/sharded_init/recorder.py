"""Placeholders and the context that records what is done to them.

A placeholder is a tensor on the meta device (shape and dtype, no storage) registered with the active
:class:`Recorder`. While the recorder is active, two torch modes watch every call:

* a dispatch mode sees every aten op. An op on a placeholder is either recorded (the random, fill and
  elementwise in-place ops of :mod:`.record` on the whole tensor), or harmless (views, which stay
  placeholders of the same record; ``.to(dtype)``/``clone``, which give a derived placeholder; factory
  ops such as ``new_empty``/``empty_like``, which only read the shape), or anything else — then the
  placeholder is materialised (the full tensor, the recorded ops replayed on it) and the op runs on it,
  with one log line naming the op and the tensor. Materialised placeholders are never turned into real
  tensors in place (torch cannot re-point a meta tensor at real memory): every alias stands for a
  view of the record's real tensor, substituted op by op, and :meth:`Recorder.take_parameters` swaps
  the module's parameters at the end. A random op on a CUDA placeholder whose kind failed the
  self-check (:mod:`.selfcheck`, said once in one line) falls back the same way, each with a debug line.
* a function mode answers the Python-level questions a meta tensor would answer wrongly: ``device``,
  ``is_meta``, ``is_cuda``, ``is_cpu``, ``get_device()``, and ``.to()``/``.cuda()``/``.cpu()`` to the
  device it already stands for (no-ops, as on a real tensor).

torch >= 2.13's ``trunc_normal_`` is rejection sampling (its number of draws depends on the values):
it is recorded whole (:class:`.record.CompositeOp`) on the CPU; on CUDA it is not recordable and falls
back at its first comparison. Older versions' ``trunc_normal_`` (uniform_, erfinv_, mul_, add_, clamp_)
is recorded op by op.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.nn.init as nn_init
from torch.utils import _python_dispatch
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_map

from ztriton.sharded_init import replay as _replay
from ztriton.sharded_init import selfcheck
from ztriton.sharded_init.aten_ops import (COPIES, FACTORIES, FILLS, METADATA, POINTWISE, RANDOM, check_arguments,
                                           is_view, same_place, scalars_only, tensor_arguments,
                                           trunc_normal_is_pointwise, whole)
from ztriton.sharded_init.callers import caller_context, origin
from ztriton.sharded_init.modes import Dispatch, Functions, Paused
from ztriton.sharded_init.record import Record, empty

logger = logging.getLogger("ztriton")

__all__ = ["Recorder", "active_recorder", "placeholder", "prepare"]

_local = threading.local()


def _stack() -> list["Recorder"]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def active_recorder() -> "Recorder | None":
    """The innermost active recorder of this thread, if any."""
    stack = _stack()
    return stack[-1] if stack else None


def placeholder(shape, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """A placeholder registered with the active recorder (see :meth:`Recorder.placeholder`)."""
    recorder = active_recorder()
    if recorder is None:
        raise RuntimeError("sharded_init.placeholder needs an active Recorder: create it inside `with Recorder():`")
    return recorder.placeholder(shape, dtype, device)


def prepare() -> None:
    """Probe, once, what the recorder needs to know of this torch (how ``trunc_normal_`` draws). Call it
    before patching torch's constructors (as ``zero.Init`` does): the probe runs real ops."""
    trunc_normal_is_pointwise()


class Recorder:
    """Records init calls on placeholders made while it is active (``with Recorder() as r:``).

    Args:
        fallback_device: where a placeholder that meets an op the recorder cannot replay is
            materialised (default: the device it stands for, which keeps every value and every
            generator exactly as without placeholders; ``"cpu"`` saves device memory, but a random
            op that falls back then draws from the CPU generator).
    """

    def __init__(self, fallback_device: torch.device | str | None = None):
        self.fallback_device = None if fallback_device is None else torch.device(fallback_device)
        self._records: dict[int, Record] = {}
        self._paused = False
        self._modes: list = []  # (function mode, dispatch mode) while watching, see _watch
        self.active = False  # between __enter__ and __exit__
        self._thread: int | None = None  # the thread that entered: the one whose mode stacks hold ours
        self._patched: list[tuple[Any, str, Any]] = []
        self.fallbacks: list[tuple[str, Record]] = []  # (op, record), one per materialised record

    # ---- context

    def __enter__(self) -> "Recorder":
        pointwise_trunc_normal = trunc_normal_is_pointwise()  # probed before our modes watch it
        if not pointwise_trunc_normal:
            self._patch(nn_init, "_no_grad_trunc_normal_", self._trunc_normal_wrapper(nn_init._no_grad_trunc_normal_))
        self.active = True
        self._thread = threading.get_ident()
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().remove(self)
        self.active = False
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        self._unwatch(*exc)

    # The modes watch only while a placeholder exists: a Python mode costs every op of the construction
    # 5-15 us (about 1,200 ops and 6 ms for the demo's 13-param model), and without a placeholder they
    # have nothing to answer. Pushed by the first placeholder, popped when the last record is released,
    # if they are still the innermost modes (else at the recorder's exit: a mode pushed after ours
    # must be popped first).

    def can_watch(self) -> bool:
        """Whether a placeholder can be made now. Torch's mode stacks are per thread, and a mode's exit
        pops whatever is on top: our modes may be pushed only on the thread that entered the recorder
        (its exit pops them there) and only where no other mode is on the stacks, which would then be
        exited from above ours. A ``torch.device`` context does not count: it keeps itself at the
        bottom of the stack."""
        if self._modes:
            return threading.get_ident() == self._thread
        if not self.active or threading.get_ident() != self._thread:
            return False
        if _python_dispatch._len_torch_dispatch_stack() > 0:
            return False
        depth = torch._C._len_torch_function_stack()
        return all(isinstance(torch._C._get_function_stack_at(i), DeviceContext) for i in range(depth))

    def _require_watch(self) -> None:
        if not self.can_watch():
            raise RuntimeError("a placeholder cannot be made here: another torch mode is active, or this is not the "
                               "thread that entered the Recorder; make the tensor outside that mode or on that thread")

    def _watch(self) -> None:
        if self._modes:
            return
        self._require_watch()
        functions, dispatch = Functions(self), Dispatch(self)
        functions.__enter__()
        try:
            dispatch.__enter__()
        except BaseException:
            functions.__exit__(None, None, None)
            raise
        self._modes = [functions, dispatch]

    def _unwatch(self, *exc) -> None:
        if not self._modes:
            return
        functions, dispatch = self._modes
        self._modes = []
        try:
            dispatch.__exit__(*exc)
        finally:
            functions.__exit__(*exc)

    def _unwatch_if_idle(self) -> None:
        if not self._records:
            self._step_aside()

    def _step_aside(self) -> bool:
        """Pop the modes if they are watching and innermost (not inside one of their own handlers, where
        torch has taken them off the stack, nor under a mode pushed after them)."""
        if not self._modes:
            return False
        functions, dispatch = self._modes
        depth = torch._C._len_torch_function_stack()
        if not (depth > 0 and torch._C._get_function_stack_at(depth - 1) is functions
                and _python_dispatch._get_current_dispatch_mode() is dispatch):
            return False
        self._unwatch(None, None, None)
        return True

    def _patch(self, owner, name: str, replacement) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def paused(self) -> Paused:
        """A context in which the recorder passes every op through (for the integration's own work)."""
        return Paused(self)

    # ---- placeholders and records

    def placeholder(self, shape, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` standing for one on ``device`` that allocates nothing: the init
        calls made on it are recorded, to be replayed slice by slice (:func:`~.replay.replay`)."""
        if not self.active:
            raise RuntimeError("placeholder() needs the recorder to be active (inside `with recorder:`)")
        self._require_watch()  # before anything is made
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"placeholders stand for cpu or cuda tensors, not {device}")
        shape = torch.Size(shape)
        with Paused(self, step_aside=False):  # one meta allocation: not worth popping the modes for
            tensor = empty(shape, dtype, torch.device("meta"))
        self._register(tensor, Record(tensor.shape, dtype, device, dtype, origin=origin()))
        return tensor

    def _register(self, tensor: torch.Tensor, record: Record) -> None:
        self._watch()
        record.attach(tensor)
        self._records[record.storage._cdata] = record

    def record_of(self, tensor: Any) -> Record | None:
        """The record a tensor (a placeholder, a Parameter made from one, ``.data``, a view) belongs to."""
        if not isinstance(tensor, torch.Tensor) or not self._records:
            return None
        with torch._C.DisableTorchFunction():
            if not tensor.is_meta:
                return None
            return self._records.get(tensor.untyped_storage()._cdata)

    def records(self) -> list[Record]:
        """Every record still held (not yet released)."""
        return list(self._records.values())

    def release(self, record: Record) -> None:
        """Forget ``record`` (its placeholder has been replaced by a real tensor or a partition)."""
        self._records.pop(record.storage._cdata, None)
        self._unwatch_if_idle()

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real tensor a materialised alias stands for (materialising its record if needed)."""
        record = self.record_of(tensor)
        if record is None:
            return tensor
        if not record.materialised:
            self._materialise(record, "a request for its values")
        return self._substitute(tensor, record)

    # ---- the integration's end of a module

    def take_parameters(self, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, Record | None]]:
        """Replace every placeholder parameter of ``module`` (not recursive) by a real ``nn.Parameter``.

        Returns ``(name, new_param, record)`` for each replaced parameter. ``record`` is None when the
        placeholder was materialised (a fallback): ``new_param`` then holds its full values. Otherwise
        ``new_param`` has the placeholder's shape, dtype and device but one element of storage
        (stride 0, read-only): it is meant to be partitioned straight away, its partition written by
        :func:`~.replay.replay`. Python attributes of the old parameter are copied; the same
        placeholder registered twice gives the same new parameter; records of materialised
        placeholders are released here, sharded ones when the caller calls :meth:`release`.
        """
        done: dict[int, torch.nn.Parameter] = {}
        taken = []
        for name, param in list(module._parameters.items()):
            record = self.record_of(param)
            if record is None:
                continue
            if id(param) not in done:
                done[id(param)] = self._real_parameter(param, record)
                taken.append((name, done[id(param)], None if record.materialised else record))
            module._parameters[name] = done[id(param)]
            if record.materialised:
                self.release(record)
        return taken

    def take_tensors(self, module: torch.nn.Module) -> list[str]:
        """Materialise the placeholder buffers and plain tensor attributes of ``module`` (not recursive):
        buffers are never partitioned. Returns their names."""
        names = []
        for name, buffer in list(module._buffers.items()):
            if self.record_of(buffer) is not None:
                module._buffers[name] = self.real(buffer)
                names.append(name)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and self.record_of(value):
                setattr(module, name, self.real(value))
                names.append(name)
        return names

    def _real_parameter(self, param: torch.nn.Parameter, record: Record) -> torch.nn.Parameter:
        if record.materialised:
            data = self._substitute(param, record)
        else:
            with self.paused():
                data = empty((1,), record.dtype, record.device).expand(record.shape)
        new = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        return new

    # ---- the modes' work

    def _placeholders_in(self, args, kwargs) -> list[tuple[torch.Tensor, Record]]:
        found = []
        for leaf in tensor_arguments(args, kwargs):
            if leaf.is_meta:
                record = self._records.get(leaf.untyped_storage()._cdata)
                if record is not None:
                    found.append((leaf, record))
        return found

    def _handle(self, func, args, kwargs, found):
        if any(record.materialised for _, record in found):
            return self._fallback(func, args, kwargs, found)
        target, record = found[0]
        others = found[1:]
        packet = func.overloadpacket
        if (func in RANDOM or func in FILLS or func in POINTWISE) and args and args[0] is target and not others \
                and whole(target, record) and scalars_only(args[1:], kwargs):
            if func in RANDOM and not self._replay_verified(func, record):
                return self._fallback(func, args, kwargs, found, quiet=True)
            check_arguments(func, target, args[1:], kwargs)
            if func in RANDOM:
                record.record_random(func, target, args[1:], kwargs)
            else:
                record.record_fill(func, target, args[1:], kwargs, overwrites=func in FILLS)
            return target
        if is_view(func) or func in METADATA:
            return func(*args, **kwargs)
        if func in COPIES and args and args[0] is target and not others and whole(target, record) \
                and same_place(kwargs.get("device"), record.device) and kwargs.get("layout") in (None, torch.strided):
            meta_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking")}
            result = func(*args, **meta_kwargs)
            if result.is_contiguous():
                self._register(result, record.derive(result.dtype, result))
                return result
            del result
        if packet in FACTORIES and args and args[0] is target and not others:
            if kwargs.get("device") is None:
                kwargs = {**kwargs, "device": record.device}
            return func(*args, **kwargs)
        return self._fallback(func, args, kwargs, found)

    def _replay_verified(self, func, record: Record) -> bool:
        """Whether ``func`` on ``record`` may be recorded: its kind's self-check passed on the device."""
        with Paused(self, step_aside=False):  # the check's real ops pass through; a lookup after the first
            return selfcheck.replay_verified(func, record.dtype, record.device)

    def _fallback(self, func, args, kwargs, found, quiet: bool = False):
        """Materialise every placeholder the op touches, then run the op on the real tensors. ``quiet``:
        the reason was said once already (a failed self-check), so each tensor's line is a debug line."""
        for _, record in found:
            if not record.materialised:
                self._materialise(record, str(func), quiet)
        substitutes = {id(t): self._substitute(t, r) for t, r in found}
        args, kwargs = tree_map(lambda x: substitutes.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        return func(*args, **kwargs)

    def _materialise(self, record: Record, op: str, quiet: bool = False) -> None:
        device = self.fallback_device or record.device
        level = logging.DEBUG if quiet else logging.WARNING
        if logger.isEnabledFor(level):
            logger.log(level, "ztriton sharded init: %s on %s cannot be recorded (%s); materialising it in full on "
                       "%s (%d recorded ops replayed)", op, record.describe(), caller_context() or "no caller found",
                       device, len(record.ops))
        with self.paused():
            record.real = _replay.materialise(record, device)
        self.fallbacks.append((op, record))

    @staticmethod
    def _substitute(tensor: torch.Tensor, record: Record) -> torch.Tensor:
        """The view of the record's real tensor that the alias ``tensor`` stands for."""
        base = record.real
        if tensor.dtype != base.dtype:
            base = base.view(tensor.dtype)
        return base.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    # ---- trunc_normal_ (torch >= 2.13: rejection sampling)

    def _trunc_normal_wrapper(self, original: Callable) -> Callable:
        def _no_grad_trunc_normal_(tensor, mean, std, a, b, generator=None):
            record = self.record_of(tensor)
            if record is None or record.materialised or record.device.type != "cpu" or not whole(tensor, record):
                return original(tensor, mean, std, a, b, generator=generator)
            with self.paused():
                record.record_composite(original, tensor, (mean, std, a, b), {"generator": generator})
            return tensor

        _no_grad_trunc_normal_.__wrapped__ = original
        return _no_grad_trunc_normal_
