"""The README's recipes, run as written, so that they cannot rot.

A block preceded by ``<!-- readme-test: file NAME -->`` is written to NAME in a fresh directory; a block
preceded by ``<!-- readme-test: run -->`` is run there with bash (``python`` and ``torchrun`` are this
environment's), in README order. Nothing else is set for them: each recipe carries its own environment.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MARKED = re.compile(r"<!-- readme-test: (file (?P<name>\S+)|run) -->\n```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)


def marked_blocks(text: str) -> list[tuple[str | None, str, str]]:
    """(file name or None for a block to run, language, body) of every marked block, in order."""
    return [(m["name"], m["lang"], m["body"]) for m in MARKED.finditer(text)]


def test_marker_parsing_finds_only_marked_blocks():
    text = ("```python\nnot me\n```\n<!-- readme-test: file a.py -->\n```python\nprint(1)\n```\n"
            "<!-- readme-test: run -->\n```bash\npython a.py\n```\n<!-- readme-test: run -->\n\n```bash\nx\n```\n")
    assert marked_blocks(text) == [("a.py", "python", "print(1)"), (None, "bash", "python a.py")]


def test_readme_recipes_run_as_written(tmp_path):
    blocks = marked_blocks(README.read_text())
    assert any(name == "train.py" for name, _, _ in blocks) and any(name is None for name, _, _ in blocks)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "DS_ACCELERATOR", "ZTRITON_AUTOLOAD", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for name, lang, body in blocks:
        if name is not None:
            (tmp_path / name).write_text(body + "\n")
            continue
        assert lang == "bash"
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"README block failed:\n{body}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        # the key took effect without `import ztriton`: at stage 3 (python) and stage 2 (torchrun)
        assert "ztriton: ZeRO-3 lp_param_buffer (defragment)" in done.stdout, done.stdout
        assert "ztriton: ZeRO-1/2 flatten, group 0: tier=device" in done.stdout, done.stdout
        assert done.stdout.count("step 2: loss") == 2, done.stdout
