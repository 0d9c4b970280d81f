"""Wall-clock call tree of a block, through every module-level function of the named modules.

    with traced(["ztriton.flatten.groups", "ztriton.comm"]) as calls:
        work()
    print("\n".join(calls.lines(min_ms=0.5)))

Each module-level function defined in one of ``modules`` is wrapped for the block, and every reference to it
in those modules' namespaces (``from x import f`` binds another name) points at the wrapper, so the tree sees
the calls the modules make to each other; classes' methods and ``__init__`` too. Only the thread that entered
the block is traced (the calls of other threads, such as a preload's, run unwrapped: one stack). A line per
call path: inclusive ms, the part spent in no traced child ("self": C calls, device syncs, untraced Python), and
the call count. Host ``perf_counter`` only: the device's work shows where a call waits for it. ~1 us of overhead
per call. For finding where a fresh process's step spends its time, where cProfile's overhead and lost frames
(session 11) make its figures unreliable.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import time
from typing import Iterator


class CallTree:
    def __init__(self) -> None:
        self.inclusive: dict[tuple[str, ...], float] = {}
        self.children_time: dict[tuple[str, ...], float] = {}
        self.count: dict[tuple[str, ...], int] = {}
        self.first_seen: dict[tuple[str, ...], int] = {}
        self._stack: list[str] = []
        self._thread = threading.get_ident()  # the one thread whose calls build the tree

    def wrap(self, label: str, fn):
        tree = self

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if threading.get_ident() != tree._thread:
                return fn(*args, **kwargs)
            tree._stack.append(label)
            path = tuple(tree._stack)
            tree.first_seen.setdefault(path, len(tree.first_seen))
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                tree._stack.pop()
                tree.inclusive[path] = tree.inclusive.get(path, 0.0) + spent
                tree.count[path] = tree.count.get(path, 0) + 1
                parent = path[:-1]
                tree.children_time[parent] = tree.children_time.get(parent, 0.0) + spent

        return traced

    def lines(self, min_ms: float = 0.5) -> list[str]:
        out = []
        for path in sorted(self.inclusive, key=self._tree_order):
            ms = self.inclusive[path] * 1e3
            if ms < min_ms:
                continue
            own = ms - self.children_time.get(path, 0.0) * 1e3
            out.append(f"{'  ' * (len(path) - 1)}{ms:9.2f} ms  (self {own:7.2f})  {path[-1]}  x{self.count[path]}")
        return out

    def as_dict(self, min_ms: float = 0.0) -> dict[str, dict]:
        return {" > ".join(p): {"ms": self.inclusive[p] * 1e3, "calls": self.count[p]}
                for p in sorted(self.inclusive, key=self._tree_order) if self.inclusive[p] * 1e3 >= min_ms}

    def _tree_order(self, path: tuple[str, ...]) -> tuple[int, ...]:
        """Parents before children, siblings in the order first called."""
        return tuple(self.first_seen[path[:i + 1]] for i in range(len(path)))


@contextlib.contextmanager
def traced(modules: list[str], extra: tuple[str, ...] = ()) -> Iterator[CallTree]:
    """``extra``: more callables by dotted name (``"torch._foreach_copy_"``, ``"torch.Tensor.copy_"``), each
    replaced on its owner for the block (methods of classes the modules define are traced too)."""
    tree = CallTree()
    loaded = [importlib.import_module(name) for name in modules]
    originals: dict[int, tuple[object, object]] = {}  # id(original) -> (original, wrapper)
    replaced = []
    for module in loaded:
        short = module.__name__.rsplit('.', 1)[-1]
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and value.__module__ == module.__name__ and id(value) not in originals:
                originals[id(value)] = (value, tree.wrap(f"{short}.{name}", value))
            elif inspect.isclass(value) and value.__module__ == module.__name__:
                for attr, method in list(vars(value).items()):
                    if inspect.isfunction(method) and (attr == "__init__" or not attr.startswith("__")):
                        setattr(value, attr, tree.wrap(f"{short}.{value.__name__}.{attr}", method))
                        replaced.append((value, attr, method))
    for dotted in extra:
        owner_name, attr = dotted.rsplit(".", 1)
        owner = _resolve(owner_name)
        real = getattr(owner, attr)
        setattr(owner, attr, tree.wrap(dotted, real))
        replaced.append((owner, attr, real))
    for module in loaded:
        namespace = vars(module)
        for name, value in list(namespace.items()):
            if id(value) in originals and originals[id(value)][0] is value:
                namespace[name] = originals[id(value)][1]
                replaced.append((namespace, name, value))
    try:
        yield tree
    finally:
        for owner, name, value in reversed(replaced):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)


def _resolve(dotted: str):
    """A module or an attribute path under one (``torch.Tensor``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            owner = getattr(owner, attr)
        return owner
    raise ImportError(dotted)
