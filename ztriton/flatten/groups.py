"""ZeRO-1/2 flatten: each optimizer group's params into one aligned flat buffer, as DeepSpeed 0.18-0.19 lays it out.

:func:`flatten_groups` does what ``DeepSpeedZeroOptimizer.__init__`` does to each param group (see
``docs/architecture.md``): the trainable, non-empty params, optionally in round-robin order, end to
end with optional 16-byte alignment pads and a zero tail up to a multiple of ``2 * W`` elements; then
every param's ``.data`` becomes its view of that buffer. The bytes equal DeepSpeed's
``bit16_groups_flat``; how they get there depends on memory (``docs/architecture.md``):

* ``device``: allocate the flat buffer beside the params, one ``kernels.pack(..., fresh=True)`` (the biggest
  pieces first, pads zeroed). Device peak: params + buffer, 2M for a group of M bytes.
* ``distributed`` (W > 1): pack only this rank's 1/W window into a partition buffer, free the params,
  allocate the flat buffer and all-gather the partitions into it. Peak M + M/W. Collective: every
  rank of ``group`` takes it together.
* ``evict``: move just enough params to (pinned) host memory for the flat buffer to fit, pack the
  rest device to device and copy each evicted one back from the pinned spill (one DMA each). Peak at most
  what is free.
* ``host``: copy every param into one (pinned) host buffer, free them, allocate the flat buffer and
  copy once. Device peak M.

An allocation failure in a tier falls through to the next (``policy.flatten_fallbacks``); params keep
their values at every step (some may then live in host memory until a later tier re-points them).

This module is the entry point and its checks; :mod:`ztriton.flatten.tiers` holds the tiers.
"""
from __future__ import annotations

import logging
import time
from operator import attrgetter
from dataclasses import FrozenInstanceError
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ztriton import memory, policy, staging
from ztriton.comm import World, agree, agreed, min_over_ranks, world_of
from ztriton.flatten.tiers import TIERS, Group, TierInputs
from ztriton.kernels import byte_extents
from ztriton.kernels.checks import each
from ztriton.layout import FlatGroupLayout, zero12_group_layout
from ztriton.memory import format_bytes
from ztriton.policy import FlattenDecision, Options, Tier

__all__ = ["FlatGroup", "flatten_groups"]

logger = logging.getLogger("ztriton")
_REQUIRES_GRAD = attrgetter("requires_grad")


_FIELDS = ("flat", "params", "layout", "tier", "rank", "decision")  # FlatGroup's, in its constructor's order


class FlatGroup:
    """One optimizer group after :func:`flatten_groups`.

    ``flat`` is the detached 1-D flat buffer (DeepSpeed's ``bit16_groups_flat[i]``); ``params`` are
    the group's participating params (trainable, non-empty) in flat order, each now a view of
    ``flat`` (unless :func:`flatten_groups` was told ``repoint=False`` and the device tier built it);
    ``layout.order[k]`` is the index, in the group as handed in, of ``params[k]``. ``tier``
    is the tier that built the buffer (``None`` for a group with nothing to flatten, whose ``flat``
    is empty) and ``decision`` the policy's choice with the figures it was made from.

    Read-only (setting or deleting a field raises ``dataclasses.FrozenInstanceError``), compared by identity,
    copied and pickled field by field, as the frozen dataclass it was. A plain class, not a dataclass (``dataclasses``'
    ``fields`` and ``replace`` do not apply): the key imports this module in a fresh process's config parse, on the
    caller's thread, where a dataclass's creation was ~0.6 ms.
    """

    __slots__ = (*_FIELDS, "__weakref__")
    __match_args__ = _FIELDS
    flat: torch.Tensor
    params: tuple[torch.Tensor, ...]
    layout: FlatGroupLayout
    tier: Tier | None
    rank: int
    decision: FlattenDecision | None

    def __init__(self, flat: torch.Tensor, params: tuple[torch.Tensor, ...], layout: FlatGroupLayout,
                 tier: Tier | None, rank: int, decision: FlattenDecision | None = None) -> None:
        for name, value in zip(_FIELDS, (flat, params, layout, tier, rank, decision)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if type(self) is FlatGroup or name in _FIELDS:  # a subclass may add attributes of its own, as before
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if type(self) is FlatGroup or name in _FIELDS:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        object.__delattr__(self, name)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS)
        return f"{type(self).__name__}({fields})"

    def __reduce__(self):  # copy, deepcopy and pickle rebuild it through __init__ (its fields refuse assignment)
        return type(self), tuple(getattr(self, name) for name in _FIELDS)

    @property
    def order(self) -> tuple[int, ...]:
        return self.layout.order

    @property
    def offsets(self) -> tuple[int, ...]:
        """Element offset in ``flat`` of each of ``params`` (DeepSpeed's ``round_robin_bit16_offsets``)."""
        return self.layout.offsets

    @property
    def paddings(self) -> tuple[int, ...]:
        """Zeros after each of ``params`` (DeepSpeed's ``round_robin_bit16_padding``)."""
        return self.layout.paddings

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def partition(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s partition: a view of ``flat`` of ``layout.partition_numel`` elements."""
        start, end = self.layout.rank_window(rank)
        return self.flat.narrow(0, start, end - start)


# --------------------------------------------------------------------------------------------
# The entry point.


def flatten_groups(param_groups: Sequence[Any], group: Any = None, *, round_robin: bool = False,
                   parameter_alignment: bool = False, tier: Tier | str | None = None,
                   headroom_bytes: int | None = None, chunk_bytes: int | None = None,
                   repoint: bool = True) -> list[FlatGroup]:
    """Flatten every param group into one flat buffer laid out as DeepSpeed 0.19.8's ZeRO-1/2 optimizer does.

    ``param_groups``: torch-optimizer style dicts with a ``"params"`` entry (e.g. ``optimizer.param_groups``)
    or lists of tensors; one :class:`FlatGroup` comes back per group, in order. A param takes part if
    it requires grad and has elements (DeepSpeed's ``is_optimized_parameter``); the others are left
    as they are. A group with no such param gets a :class:`FlatGroup` with an empty ``flat`` and
    ``tier=None`` (DeepSpeed itself fails on such a group).

    ``group``: the data-parallel ``torch.distributed`` process group whose size is W (default: the
    default group if torch.distributed is initialised, else a world of one). With W > 1 the call is
    collective: every rank calls it with the same groups. ``round_robin`` and
    ``parameter_alignment`` are DeepSpeed's ``round_robin_gradients`` and ``parameter_alignment``.

    ``tier`` forces a tier ("device", "distributed", "evict", "host"); by default each group's tier
    is chosen from measured free memory minus ``headroom_bytes`` (default 1 GiB) and logged.
    ``chunk_bytes`` sizes host-to-device copies (default: from free memory). ``repoint=False`` leaves the
    re-pointing of a group built by the device tier to the caller, for one that does it anyway right after
    (DeepSpeed's optimizer re-points every param into the buffer it gets back): those params keep their own
    memory until then, so with several groups each group's params and buffer are both held until the caller
    re-points (pass one group per call where memory is tight). The other tiers moved the params' values out
    of their memory and re-point them whatever ``repoint`` says.

    Raises ``TypeError``/``ValueError`` before anything moves on bad input: mixed dtypes or devices
    within a group's participating params, params that share memory (tied weights listed twice,
    views of one tensor), non-tensors. Raises ``torch.OutOfMemoryError`` if every tier runs out of
    memory; the params then still hold their values (moved back to their device where memory allows,
    else left in host memory, as the message says).
    """
    world = world_of(group)

    def checks():
        forced = policy.parse_tier(tier)
        policy.check_tier_fits_world(forced, world.size)
        options = Options.of(headroom_bytes=headroom_bytes, chunk_bytes=chunk_bytes)
        lists = _param_lists(param_groups)
        groups = [_prepare(i, params, world.size, round_robin, parameter_alignment) for i, params in enumerate(lists)]
        return forced, options, lists, groups

    # A check may fail on one rank only: every rank raises here, or none does.
    forced, options, lists, groups = agreed(world, checks, "flatten_groups: checking the param groups")
    # The checks of the params themselves guard what moves, not the device tier's pack, which only reads them into
    # a new buffer: they run before the first param moves, the device tier's while its first copies run.
    checks = _ParamChecks(_Once(lambda: _check_params(groups, lists)),
                          _Once(lambda: _check_no_shared_memory(groups, lists)))
    return [_flatten_group(g, world, forced, options, checks, repoint) for g in groups]


class _ParamChecks:
    """The input checks that guard only the params, each run once for all groups before any param moves:
    ``fit`` (:func:`_check_params`), which the device tier runs while its first copies run, and ``before_moving``
    (``fit``, then no shared memory), which the device tier runs once its pack is launched."""

    __slots__ = ("fit", "no_shared_memory")

    def __init__(self, fit: _Once, no_shared_memory: _Once) -> None:
        self.fit, self.no_shared_memory = fit, no_shared_memory

    def before_moving(self) -> None:
        self.fit()
        self.no_shared_memory()

    def raised(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a check's own failure (an allocation of its scratch, say), not the tier's."""
        return exc is self.fit.error or exc is self.no_shared_memory.error


class _Once:
    """A check run at most once (its exception, if any, raised each time it is asked for)."""

    def __init__(self, check: Callable[[], None]):
        self.check, self.error = check, None

    def __call__(self) -> None:
        if self.check is not None:
            check, self.check = self.check, None
            try:
                check()
            except Exception as exc:
                self.error = exc
        if self.error is not None:
            raise self.error


# --------------------------------------------------------------------------------------------
# Input checks: everything is validated before any param moves.


def _param_lists(param_groups: Sequence[Any]) -> list[list[torch.Tensor]]:
    """The params of each group as lists, from dicts with "params" or from lists of tensors."""
    if isinstance(param_groups, (torch.Tensor, dict, str, bytes, set, frozenset)) or not hasattr(param_groups, "__iter__"):
        raise TypeError("param_groups must be a list of groups (dicts with 'params', or lists of tensors), got "
                        f"{type(param_groups).__name__}; for one group of params pass [list(params)]")
    lists = []
    for i, entry in enumerate(param_groups):
        if isinstance(entry, torch.Tensor):
            raise TypeError(f"param_groups[{i}] is a tensor, not a group; for one group of params pass "
                            "[list(params)] (or optimizer.param_groups)")
        where = f"param_groups[{i}]"
        if isinstance(entry, dict):
            if "params" not in entry:
                raise TypeError(f"{where} is a dict without 'params'")
            entry, where = entry["params"], f"{where}['params']"
        params = [entry] if isinstance(entry, torch.Tensor) else _listed(entry, where)
        for j, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"param_groups[{i}] params[{j}] is a {type(param).__name__}, not a tensor")
        lists.append(params)
    return lists


def _listed(params: Any, where: str) -> list:
    """A group's params as a list. Only an ordered collection will do: every rank must put the params of a
    group in one order, which a set or a mapping does not promise."""
    if isinstance(params, (str, bytes, dict, set, frozenset)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{where} must be a list of tensors (or one tensor), got {type(params).__name__}; "
                        "pass the group's params as a list, e.g. {'params': list(model.parameters())}")
    return list(params)


def _prepare(index: int, params: list[torch.Tensor], world_size: int, round_robin: bool,
             parameter_alignment: bool) -> Group:
    """One group's layout, with the dtype and device of its first participating param (:func:`_check_params`
    checks that the others share them).

    A param takes part if it requires grad and has elements (DeepSpeed's ``is_optimized_parameter``).
    """
    numels = each("numel", params)
    trainable = list(map(_REQUIRES_GRAD, params))
    first = next((p for p, n, t in zip(params, numels, trainable) if t and n > 0), params[0] if params else None)
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    device = first.device if first is not None else torch.device("cpu")
    layout = zero12_group_layout(numels, world_size, element_size=dtype.itemsize,
                                 trainable=trainable, round_robin=round_robin, parameter_alignment=parameter_alignment)
    ordered = [params[j] for j in layout.order]
    return Group(index, ordered, [p.shape for p in ordered], layout, dtype, device)


def _check_params(groups: list[Group], lists: list[list[torch.Tensor]]) -> None:
    """The participating params of each group share one dtype and one device (those of its flat buffer), and hold
    values the kernels can copy (``policy.check_tensors``)."""
    for g, params in zip(groups, lists):
        # One pass over thousands of params in the common case; _name_mixed only names the culprit.
        if g.params and {(p.dtype, p.device) for p in g.params} != {(g.dtype, g.device)}:
            _name_mixed(g.index, params, sorted(g.layout.order))
    for g in groups:
        order = g.layout.order
        policy.check_tensors(g.params, lambda k, g=g, order=order: f"param_groups[{g.index}] params[{order[k]}]",
                             hint=" or freeze it (requires_grad=False)")


def _name_mixed(index: int, params: list[torch.Tensor], members: list[int]) -> None:
    """Raise for the first participating param whose dtype or device differs from the first one's."""
    where = f"param_groups[{index}]"
    first = members[0]
    for j in members:
        p = params[j]
        if p.dtype != params[first].dtype:
            raise TypeError(f"{where} mixes dtypes: params[{first}] is {params[first].dtype}, params[{j}] is "
                            f"{p.dtype}; a flat buffer holds one dtype: cast the model to one dtype "
                            "(e.g. model.bfloat16()) or put the params of each dtype in their own group")
        if p.device != params[first].device:
            raise ValueError(f"{where} mixes devices: params[{first}] is on {params[first].device}, params[{j}] "
                             f"on {p.device}; move the model to one device first (model.to(device))")


def _check_no_shared_memory(groups: list[Group], lists: list[list[torch.Tensor]]) -> None:
    """Participating params (of all groups) must not share an element of memory: each gets its own slot
    of a flat buffer, so tied weights, one param listed twice or overlapping views would come apart.

    Disjoint views of one tensor (``fused[:, :4]`` and ``fused[:, 4:]``, interleaved in memory) are
    fine, as in DeepSpeed: params whose byte extents overlap are compared element by element (as sets
    of strided runs), which costs something only for such clusters.
    """
    by_device: dict[str, list[Group]] = {}  # one device per group, checked by _prepare
    for g in groups:
        by_device.setdefault(str(g.device), []).append(g)
    for device in sorted(by_device):
        on_device = by_device[device]
        group_of = np.concatenate([np.full(len(g.layout.order), g.index, dtype=np.int64) for g in on_device])
        index_in = np.concatenate([np.asarray(g.layout.order, dtype=np.int64) for g in on_device])
        begins, ends = byte_extents([lists[g.index][j] for g in on_device for j in g.layout.order])
        for cluster in _overlapping(begins, ends, group_of, index_in):
            _check_cluster([(int(group_of[k]), int(index_in[k])) for k in cluster], lists)


def _overlapping(begins: np.ndarray, ends: np.ndarray, *ties: np.ndarray) -> list[np.ndarray]:
    """The clusters of ranges ``[begins, ends)`` that overlap transitively, two or more ranges each, as
    index arrays in order of begin (then end, then ``ties``). Vectorised: thousands of params and no
    cluster is the common case."""
    if not len(begins):
        return []
    order = np.lexsort((*reversed(ties), ends, begins))
    reach = np.maximum.accumulate(ends[order])
    cluster_of = np.cumsum(np.concatenate([[True], begins[order][1:] >= reach[:-1]]))  # a new one where none reaches
    return [order[cluster_of == c] for c in np.flatnonzero(np.bincount(cluster_of) > 1)]


def _check_cluster(cluster: list[tuple[int, int]], lists: list[list[torch.Tensor]]) -> None:
    """Params (group, index) whose byte extents overlap: raise for the first two that share an element."""
    spans = [_byte_spans(lists[i][j]) for i, j in cluster]
    begins = np.concatenate([s[0] for s in spans])
    ends = np.concatenate([s[1] for s in spans])
    owner = np.concatenate([np.full(len(s[0]), k) for k, s in enumerate(spans)])
    order = np.argsort(begins, kind="stable")
    begins, ends, owner = begins[order], ends[order], owner[order]
    reach = np.maximum.accumulate(ends)
    hits = np.flatnonzero(begins[1:] < reach[:-1])
    if not len(hits):
        return
    k = int(hits[0]) + 1
    first = int(owner[int(np.argmax(ends[:k] > begins[k]))])
    a, b = sorted((cluster[first], cluster[int(owner[k])]))
    same = lists[a[0]][a[1]] is lists[b[0]][b[1]]
    what = "are the same tensor (listed twice)" if same else "share memory (tied weights, or overlapping views)"
    raise ValueError(f"param_groups[{a[0]}] params[{a[1]}] and param_groups[{b[0]}] params[{b[1]}] {what}; each "
                     "param gets its own slot of a flat buffer, so they would come apart: pass a shared "
                     "param once (model.parameters() does) or untie it (clone one of them)")


def _byte_spans(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The bytes ``t`` covers as ``[begin, end)`` spans (absolute addresses), one per contiguous stretch.

    The set of elements a view covers does not depend on the order of its dims: sorted by stride and
    merged where contiguous, a transposed or sliced view becomes few long runs.
    """
    size = t.element_size()
    dims = sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n != 1), key=lambda d: -d[1])
    merged: list[list[int]] = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    inner = merged.pop() if merged and merged[-1][1] == 1 else [1, 1]
    starts = np.zeros(1, dtype=np.int64)
    for n, s in merged:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    begins = t.data_ptr() + starts * size
    return begins, begins + inner[0] * size


# --------------------------------------------------------------------------------------------
# One group: decide, try tiers in order, re-point the params.


def _flatten_group(g: Group, world: World, forced: Tier | None, options: Options, checks: _ParamChecks,
                   repoint: bool) -> FlatGroup:
    """One group through its tiers. With W > 1 every rank agrees on the outcome before the next group
    (whose first step is a collective): a rank that failed must not leave the others waiting in it."""
    if not g.params:
        logger.info("ztriton flatten group %d: no trainable non-empty params, empty flat buffer", g.index)
        flat = torch.empty(0, dtype=g.dtype, device=g.device)
        return FlatGroup(flat, (), g.layout, None, world.rank)
    outcome = agree(world, lambda: _build(g, world, forced, options, checks, repoint))
    if outcome.ok:
        return outcome.value
    if outcome.error is not None:
        raise outcome.error
    raise RuntimeError(f"flatten group {g.index} failed on another rank (its error says why); on this rank every "
                       f"param keeps its values (those of groups 0 to {g.index} may now be views of new flat buffers). "
                       "Fix the cause on that rank and call again on every rank")


def _build(g: Group, world: World, forced: Tier | None, options: Options, checks: _ParamChecks,
           repoint: bool) -> FlatGroup:
    """The group's tiers in the policy's order; ``checks.before_moving`` (the input checks that only guard the
    params themselves) runs before a tier that moves params, or after the device tier's pack (which runs
    ``checks.fit`` while its first copies run) and before the params are re-pointed (``repoint``; else the caller
    re-points them)."""
    start = time.perf_counter()
    step = agree(world, lambda: memory.probe_memory(g.device))
    if not step.ok:
        raise RuntimeError(f"flatten group {g.index}: the memory probe failed ({step.describe()}); nothing moved")
    figures = step.value
    # Every rank must choose the same tier: decide on the smallest figures. The evict and host tiers spill
    # into the pool, whose idle memory the probe sees as used; the distributed tier's backup is pageable.
    spillable = figures.host_available + staging.spill_pool().idle_bytes
    free, host, spill = min_over_ranks([figures.device_free, figures.host_available, spillable], world)
    decision = policy.choose_flatten_tier(g.nbytes, world.size, free, spill, options.headroom_bytes, forced)
    policy.log_decision(f"flatten group {g.index}", decision, figures)
    inputs = TierInputs(decision, world, options, host, checks.fit)

    failures = []
    for tier in policy.flatten_fallbacks(decision.tier):
        if tier is Tier.DISTRIBUTED:  # a collective tier: every rank enters it, or none does
            agreed(world, checks.before_moving, f"flatten group {g.index}: checking the params",
                   f"group {g.index}'s params were not moved")
        elif tier is not Tier.DEVICE:
            checks.before_moving()
        try:
            flat = TIERS[tier](g, inputs)
        except torch.OutOfMemoryError as exc:
            if checks.raised(exc):  # raised by the checks the device tier runs while it copies: nothing moved
                raise
            failures.append(f"{tier.value}: {exc}")
            logger.warning("ztriton flatten group %d: tier %s failed (%s); trying the next tier",
                           g.index, tier.value, exc)
            continue
        except BaseException as exc:
            where = _restore(g)
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"ztriton flatten group {g.index}, tier {tier.value}: the params keep their values: "
                             f"{where}")
            raise
        checks.before_moving()  # after the device tier: the params are untouched, the new buffer is dropped
        # Without repoint only the device tier leaves them: its params still hold their own memory. A tier that
        # moved params away (host copies, a lent spill block) re-points them now, so that a caller that fails
        # before its own re-pointing leaves no param in host memory.
        if repoint or tier is not Tier.DEVICE:
            _alias(g, flat)
        logger.info("ztriton flatten group %d: %d params, %s flattened by tier %s in %.2f s", g.index,
                    len(g.params), format_bytes(g.nbytes), tier.value, time.perf_counter() - start)
        return FlatGroup(flat, tuple(g.params), g.layout, tier, world.rank, decision)

    where = _restore(g)
    raise torch.OutOfMemoryError(
        f"flatten group {g.index} ({format_bytes(g.nbytes)}): every tier ran out of memory "
        f"({'; '.join(failures)}). The params keep their values: {where}. Free device or host memory "
        "(or lower headroom_bytes) and call again")


def _alias(g: Group, flat: torch.Tensor) -> None:
    """Each param's ``.data`` becomes its view of ``flat`` (DeepSpeed's ``_update_model_bit16_weights``)."""
    base = flat.storage_offset()
    strides: dict[torch.Size, tuple[int, ...]] = {}  # models repeat a few shapes
    for p, shape, offset in zip(g.params, g.shapes, g.offsets):
        stride = strides.get(shape)
        if stride is None:
            stride = strides[shape] = memory.contiguous_strides(shape)
        # as_strided: one call per param instead of narrow + view (3x faster, for thousands of params).
        # `.data =`, as DeepSpeed does: unlike set_ it leaves the version counter alone, so a graph built
        # before the flatten still backpropagates. It runs while the pack's kernels copy.
        p.data = flat.as_strided(shape, stride, base + offset)
    g.evicted.clear()


def _restore(g: Group) -> str:
    """After every tier failed: move params that live in host memory back to their device, as far as
    memory allows. Returns where they are now, for the error message."""
    for k in sorted(g.evicted):
        try:
            back = memory.empty(g.numel(k), g.dtype, g.device, "param moved back")
            back.copy_(g.params[k].data.reshape(-1))
        except Exception:  # noqa: BLE001 -- out of memory (any class): leave this one and the rest in host memory
            break
        g.params[k].data = back.view(g.shapes[k])
        g.evicted.discard(k)
    if not g.evicted:
        return f"all are on {g.device} as before"
    return (f"{len(g.evicted)} of {len(g.params)} now live in host memory (their .data is a CPU tensor; "
            f"move them back with p.data = p.data.to('{g.device}'))")



