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
import os
import sys
import threading
from typing import Any, Callable

import torch
import torch.nn.init as nn_init
from torch.overrides import TorchFunctionMode
from torch.utils import _python_dispatch
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ztriton.sharded_init import replay as _replay
from ztriton.sharded_init import selfcheck
from ztriton.sharded_init.record import Record, empty

logger = logging.getLogger("ztriton")

__all__ = ["Recorder", "active_recorder", "placeholder", "prepare"]

aten = torch.ops.aten

RANDOM = {aten.normal_.default, aten.uniform_.default}
FILLS = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
POINTWISE = {
    aten.mul_.Scalar, aten.mul_.Tensor, aten.add_.Scalar, aten.add_.Tensor, aten.sub_.Scalar, aten.sub_.Tensor,
    aten.div_.Scalar, aten.div_.Tensor, aten.div_.Tensor_mode, aten.div_.Scalar_mode, aten.clamp_.default,
    aten.clamp_.Tensor, aten.clamp_min_.default, aten.clamp_max_.default, aten.erfinv_.default, aten.neg_.default,
    aten.abs_.default, aten.exp_.default, aten.log_.default, aten.sqrt_.default, aten.pow_.Scalar,
    aten.tanh_.default, aten.sigmoid_.default, aten.reciprocal_.default,
}
FACTORIES = {aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like,
             aten.randint_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full}
COPIES = {aten._to_copy.default, aten.clone.default}
METADATA = {aten._has_compatible_shallow_copy_type.default, aten.is_same_size.default}

_GETTERS = {torch._C.TensorBase.device, torch._C.TensorBase.is_meta, torch._C.TensorBase.is_cuda,
            torch._C.TensorBase.is_cpu, torch._C.TensorBase.data}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.get_device, torch.Tensor.new_tensor,
          torch.Tensor.__setitem__}

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
    _trunc_normal_is_pointwise()


# Frames of these are not the caller's: ztriton's own package and, by path, torch's and DeepSpeed's.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THEIRS = (os.sep + "torch" + os.sep, os.sep + "deepspeed" + os.sep)


def _origin() -> str:
    """The first frame outside torch and ztriton: where the caller asked for the tensor."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_OURS) or _THEIRS[0] in path or _THEIRS[1] in path):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _caller_context() -> str:
    """For a fallback's log line: the init function being run, if any, and the caller's place."""
    frame, init_fn = sys._getframe(1), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module in ("torch.nn.init", "transformers.initialization") and not frame.f_code.co_name.startswith("_"):
            init_fn = f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    origin = _origin()
    return ", ".join(p for p in (f"in {init_fn}" if init_fn else "", f"at {origin}" if origin else "") if p)


class _Functions(TorchFunctionMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.recorder._records:  # every call of the construction passes here: no placeholder, no question
            return func(*args, **kwargs)
        owner = getattr(func, "__self__", None)
        if (owner in _GETTERS or func in _MOVES) and args:
            record = self.recorder.record_of(args[0])
            if record is not None:
                return self.recorder._answer(func, owner, record, args, kwargs)
        return func(*args, **kwargs)


class _DispatchMode(TorchDispatchMode):
    """A dispatch mode that torch does not wrap in ``torch._dynamo.disable``. torch >= 2.5 wraps every
    mode's ``__torch_dispatch__`` so, and the wrapper imports torch._dynamo on the mode's first op
    (1.5-5 s in a fresh process, and it fails while ``zero.Init`` has replaced ``torch.Tensor.__new__``)
    and adds a Python frame to every op. Our modes only watch eager construction; nothing compiles
    through them."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _Dispatch(_DispatchMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder._paused or not recorder._records:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # our own questions get the meta tensor's true answers
            found = recorder._placeholders_in(args, kwargs)
            if not found:
                return func(*args, **kwargs)
            return recorder._handle(func, args, kwargs, found)


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
        pointwise_trunc_normal = _trunc_normal_is_pointwise()  # probed before our modes watch it
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
        functions, dispatch = _Functions(self), _Dispatch(self)
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

    def paused(self) -> "_Paused":
        """A context in which the recorder passes every op through (for the integration's own work)."""
        return _Paused(self)

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
        with _Paused(self, step_aside=False):  # one meta allocation: not worth popping the modes for
            tensor = empty(shape, dtype, torch.device("meta"))
        self._register(tensor, Record(tensor.shape, dtype, device, dtype, origin=_origin()))
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
        for leaf in _tensor_arguments(args, kwargs):
            if leaf.is_meta:
                record = self._records.get(leaf.untyped_storage()._cdata)
                if record is not None:
                    found.append((leaf, record))
        return found

    def _answer(self, func, owner, record: Record, args, kwargs):
        """A placeholder's answer to a Python-level question, as the tensor it stands for would answer."""
        tensor = args[0]
        if owner is torch._C.TensorBase.device:
            return record.device
        if owner is torch._C.TensorBase.is_meta:
            return False
        if owner is torch._C.TensorBase.is_cuda:
            return record.device.type == "cuda"
        if owner is torch._C.TensorBase.is_cpu:
            return record.device.type == "cpu"
        if owner is torch._C.TensorBase.data:  # the getter; the setter arrives with two arguments
            if len(args) == 1:
                return func(*args, **kwargs)
            return self._set_data(tensor, record, args[1])
        if func is torch.Tensor.__setitem__:
            # torch turns a number assigned here into a tensor on the target's device (meta: the value
            # would be lost before dispatch), so this one falls back before torch sees it
            if not record.materialised:
                self._materialise(record, "Tensor.__setitem__")
            return func(self._substitute(tensor, record), *args[1:], **kwargs)
        if func is torch.Tensor.new_tensor:  # made from data on the tensor's device: the one it stands for
            kwargs = {**kwargs, "device": kwargs.get("device") or record.device}
            return func(*args, **kwargs)
        if func is torch.Tensor.get_device:
            return record.device.index if record.device.type == "cuda" else -1
        if func is torch.Tensor.cuda and record.device.type == "cuda" and not kwargs and len(args) == 1:
            return tensor
        if func is torch.Tensor.cpu and record.device.type == "cpu":
            return tensor
        if func is torch.Tensor.to:
            kwargs = dict(kwargs)
            copy = kwargs.pop("copy", False)
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if _same_place(device, record.device):  # .to() the device it stands for: a dtype change at most
                if (dtype is None or dtype == tensor.dtype) and not copy:
                    return tensor
                return func(tensor, dtype=dtype or tensor.dtype, copy=copy)
            kwargs["copy"] = copy
        return func(*args, **kwargs)

    def _set_data(self, tensor: torch.Tensor, record: Record, value) -> None:
        """``placeholder.data = value``. Another placeholder: re-point, as torch does. A real tensor: the
        placeholder (and every alias) then stands for that tensor."""
        if self.record_of(value) is not None:
            tensor.data = value
            return None
        if (not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype
                or not value.is_contiguous() or tensor.storage_offset() != 0 or tensor.numel() != record.numel):
            raise NotImplementedError(
                f"cannot set .data of {record.describe()} to a {getattr(value, 'dtype', type(value))} tensor of shape "
                f"{tuple(getattr(value, 'shape', ()))}: while recording, only a contiguous tensor of the same shape "
                "and dtype can replace a whole placeholder; assign the parameter itself instead")
        if not record.materialised:
            logger.warning("ztriton sharded init: .data of %s set to a real tensor; it is no longer generated by "
                           "replay", record.describe())
            self.fallbacks.append(("Tensor.data (set)", record))
        record.real = value.view(record.shape)
        return None

    def _handle(self, func, args, kwargs, found):
        if any(record.materialised for _, record in found):
            return self._fallback(func, args, kwargs, found)
        target, record = found[0]
        others = found[1:]
        packet = func.overloadpacket
        if (func in RANDOM or func in FILLS or func in POINTWISE) and args and args[0] is target and not others \
                and _whole(target, record) and _scalars_only(args[1:], kwargs):
            if func in RANDOM and not self._replay_verified(func, record):
                return self._fallback(func, args, kwargs, found, quiet=True)
            _check_arguments(func, target, args[1:], kwargs)
            if func in RANDOM:
                record.record_random(func, target, args[1:], kwargs)
            else:
                record.record_fill(func, target, args[1:], kwargs, overwrites=func in FILLS)
            return target
        if _is_view(func) or func in METADATA:
            return func(*args, **kwargs)
        if func in COPIES and args and args[0] is target and not others and _whole(target, record) \
                and _same_place(kwargs.get("device"), record.device) and kwargs.get("layout") in (None, torch.strided):
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
        with _Paused(self, step_aside=False):  # the check's real ops pass through; a lookup after the first
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
                       "%s (%d recorded ops replayed)", op, record.describe(), _caller_context() or "no caller found",
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
            if record is None or record.materialised or record.device.type != "cpu" or not _whole(tensor, record):
                return original(tensor, mean, std, a, b, generator=generator)
            with self.paused():
                record.record_composite(original, tensor, (mean, std, a, b), {"generator": generator})
            return tensor

        _no_grad_trunc_normal_.__wrapped__ = original
        return _no_grad_trunc_normal_


class _Paused:
    """Every op passes through; the modes step aside while they are innermost (the integration's own
    work at a module's end would otherwise pay for them op by op) and come back if a record is left."""

    def __init__(self, recorder: Recorder, step_aside: bool = True):
        self.recorder, self.before, self.stepped_aside = recorder, False, False
        self.step_aside = step_aside

    def __enter__(self):
        self.before, self.recorder._paused = self.recorder._paused, True
        self.stepped_aside = self.step_aside and self.recorder._step_aside()
        return self

    def __exit__(self, *exc):
        self.recorder._paused = self.before
        if self.stepped_aside and self.recorder._records and self.recorder.active:
            self.recorder._watch()


def _tensor_arguments(args, kwargs):
    """The tensors among an aten op's arguments: each one or in a list (``Tensor[]``, ``Tensor?[]``), the
    only nesting aten schemas have. A plain loop rather than a pytree walk: it runs for every op while
    any placeholder is alive."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _same_place(device, home: torch.device) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    if device.type == "meta":
        return True
    if device.type != home.type:
        return False
    return device.index is None or home.index is None or device.index == home.index


def _whole(tensor: torch.Tensor, record: Record) -> bool:
    """Whether ``tensor`` covers the record's tensor element for element in the same order."""
    return (tensor.dtype == record.dtype and tensor.numel() == record.numel and tensor.storage_offset() == 0
            and tensor.is_contiguous())


def _scalars_only(args, kwargs) -> bool:
    """Other operands of a recordable op: numbers, or 0-dim tensors that are not placeholders."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() != 0 or leaf.is_meta:
                return False
    return True


# Dtypes whose recordable ops all have CPU kernels (float8 has almost none: it is checked on meta).
_CPU_CHECKED = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def _check_arguments(func, target: torch.Tensor, args: tuple, kwargs: dict) -> None:
    """torch's own argument checks of a recordable op (``std >= 0``, ``from <= to``, a fill value that
    fits the dtype), raised where the real call would raise them. Run on a one-element CPU tensor, with
    a private generator for random ops, rather than on the meta tensor: the meta kernels of several of
    these ops (``normal_``, ``clamp_``) are Python references whose first call imports torch._dynamo
    (1.5-5 s in a fresh process), and that import fails while ``zero.Init`` has replaced
    ``torch.Tensor.__new__``."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    if target.dtype not in _CPU_CHECKED or any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"
                                               for leaf in tree_leaves((args, kwargs))):
        func(target, *args, **kwargs)  # a device scalar cannot meet a CPU tensor: checked on meta
        return
    if func in RANDOM:
        kwargs["generator"] = torch.Generator()
    func(empty((1,), target.dtype, torch.device("cpu")), *args, **kwargs)


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


_POINTWISE_TRUNC_NORMAL: list[bool] = []


def _trunc_normal_is_pointwise() -> bool:
    """Whether this torch's ``trunc_normal_`` is one uniform_ followed by elementwise ops (<= 2.12),
    which record op by op; found once by watching it on a tiny tensor with a private generator."""
    if not _POINTWISE_TRUNC_NORMAL:
        seen: set = set()

        class Watch(_DispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.add(func)
                return func(*args, **(kwargs or {}))

        with Watch():
            nn_init._no_grad_trunc_normal_(empty((8,), torch.float32, torch.device("cpu")), 0.0, 1.0, -2.0, 2.0,
                                           generator=torch.Generator())
        _POINTWISE_TRUNC_NORMAL.append(seen <= (RANDOM | POINTWISE))
    return _POINTWISE_TRUNC_NORMAL[0]
