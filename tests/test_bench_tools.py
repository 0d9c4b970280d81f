"""The bench's own tools that other figures rest on: ``bench/trace_calls.py`` (session 11's fresh-process call
trees)."""
from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def tiny_modules(monkeypatch):
    """Two modules: ``b`` imports ``a``'s function by name (``from a import leaf``), as the library's modules do."""
    a = types.ModuleType("tiny_a")
    exec("import time\n"
         "def leaf():\n    time.sleep(0.002)\n    return 1\n"
         "class Box:\n    def __init__(self):\n        self.n = 1\n"
         "    def method(self):\n        return leaf() + 1\n", a.__dict__)
    b = types.ModuleType("tiny_b")
    b.leaf = a.leaf
    exec("def top(n):\n    return sum(leaf() for _ in range(n))\n", b.__dict__)
    for module in (a, b):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return a, b


def test_traced_builds_the_call_tree_and_puts_everything_back(tiny_modules):
    from bench.trace_calls import traced

    a, b = tiny_modules
    import threading

    originals = (a.leaf, b.leaf, a.Box.method, a.Box.__init__)
    with traced(["tiny_a", "tiny_b"], extra=("tiny_a.time.sleep",)) as calls:
        assert b.top(3) == 3 and a.Box().method() == 2
        other = threading.Thread(target=b.top, args=(5,))  # another thread's calls: not in the tree
        other.start()
        other.join()
    found = calls.as_dict()
    assert found["tiny_a.Box.__init__"]["calls"] == 1
    assert found["tiny_b.top"]["calls"] == 1
    assert found["tiny_b.top > tiny_a.leaf"]["calls"] == 3  # b's own name for a's function is traced too
    assert found["tiny_b.top > tiny_a.leaf > tiny_a.time.sleep"]["calls"] == 3
    assert found["tiny_a.Box.method > tiny_a.leaf"]["calls"] == 1
    assert found["tiny_b.top"]["ms"] >= found["tiny_b.top > tiny_a.leaf"]["ms"] >= 3 * 2.0
    lines = calls.lines(min_ms=0.0)
    assert lines[0].endswith("tiny_b.top  x1") and "tiny_a.leaf  x3" in lines[1]  # parents first, children indented
    assert (a.leaf, b.leaf, a.Box.method, a.Box.__init__) == originals
    import time
    assert a.time.sleep is time.sleep and not hasattr(time.sleep, "__wrapped__")


def test_coldstart_ab_cells_run_the_other_tree_or_say_what_shadows_it(tmp_path):
    """``bench_coldstart --ab-tree DIR`` runs DIR's own cell for ``triton@ab``: it either ran DIR's ztriton and
    kernels, or (where an editable install or start-up hook of this checkout shadows DIR, as in this suite's
    environment) the cell is an error that says so; never a silent run of this tree under the other's name."""
    import json
    import shutil
    import subprocess

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    tree = tmp_path / "other"
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if name.startswith(("ztriton/", "kernels/", "bench/")):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, tree / name)
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(root / "bench" / "bench_coldstart.py"), "--smoke", "--steps", "zero2",
                           "--backends", "triton", "--warm-repeats", "0", "--ab-tree", str(tree), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    cells = json.loads(out.read_text())["figures"]["cells"]
    ours, other = cells["zero2/triton/cold"], cells["zero2/triton@ab/cold"]
    assert {str(root)} == set(ours["ztriton_from"])
    assert ours["launches"] > 0  # a fresh process's ZeRO-2 flatten of this many params launches the kernels
    if "error" in other:
        assert "shadows it" in other["error"] and str(root) in other["error"], other["error"]
    else:
        assert set(other["ztriton_from"]) == {str(tree.resolve())}


def test_compare_traces_reads_initialize_without_the_spread_phase_and_pairs_warm_rounds():
    """``probes/compare_traces.py``: initialize less the outermost calls of the named phase (once, not again for a
    nested call of the same name), and a cell's processes (its runs, or the cell itself where it ran once)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "probes" / "compare_traces.py"
    spec = importlib.util.spec_from_file_location("compare_traces", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    phase = tool.SPREAD_PHASE
    top = "deepspeed.initialize"
    trace = {top: {"ms": 100.0}, f"{top} > a": {"ms": 70.0}, f"{top} > a > {phase}": {"ms": 60.0},
             f"{top} > a > {phase} > b > {phase}": {"ms": 20.0}}
    assert tool.without(trace, phase) == 40.0
    one, two = {"initialize_seconds": 1.0}, {"initialize_seconds": 2.0}
    cells = {"zero2/torch/warm": {"runs": [one, two]}, "zero2/torch/cold": one, "zero2/triton/warm": {"error": "x"}}
    assert tool.runs(cells, "zero2", "torch", "warm") == [one, two]
    assert tool.runs(cells, "zero2", "torch", "cold") == [one]
    assert tool.runs(cells, "zero2", "triton", "warm") == [] and tool.runs(cells, "zero2", "triton", "cold") == []
    assert tool.paired([one, two], [two, one], lambda r: r["initialize_seconds"]) == (1.5, 1.5, 0.0, 1)
