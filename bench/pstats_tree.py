"""A cProfile dump as a call tree under one function: where its cumulative time goes, child by child.

    python bench/pstats_tree.py PROFILE.pstats FUNCTION_SUBSTRING [--min-ms 4] [--depth 12]

Each line: the child's cumulative ms when called from that parent, its ``file:line(name)``, its call count.
Children under ``--min-ms`` are left out; recursion is cut where a function reappears below itself.
"""
from __future__ import annotations

import argparse
import pstats
import sys


def _label(func) -> str:
    path, line, name = func
    return f"{path.rsplit('/', 1)[-1]}:{line}({name})"


def tree(stats: pstats.Stats, root: str, min_ms: float = 4.0, depth: int = 12) -> list[str]:
    children: dict = {}
    for func, (_, _, _, _, callers) in stats.stats.items():
        for caller, figures in callers.items():
            children.setdefault(caller, []).append((func, figures))
    lines: list[str] = []

    def walk(func, level: int, above: frozenset) -> None:
        if level > depth:
            return
        for child, figures in sorted(children.get(func, []), key=lambda item: -item[1][3]):
            cumulative_ms = figures[3] * 1e3
            if cumulative_ms < min_ms or child in above:
                continue
            lines.append(f"{'  ' * level}{cumulative_ms:8.1f} ms  {_label(child)}  n={figures[1]}")
            walk(child, level + 1, above | {child})

    for func, figures in stats.stats.items():
        if root in _label(func):
            lines.append(f"{_label(func)}: {figures[3] * 1e3:.1f} ms")
            walk(func, 1, frozenset({func}))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("root", help="a substring of the root's file:line(name)")
    parser.add_argument("--min-ms", type=float, default=4.0)
    parser.add_argument("--depth", type=int, default=12)
    args = parser.parse_args(argv)
    print("\n".join(tree(pstats.Stats(args.profile), args.root, args.min_ms, args.depth)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
