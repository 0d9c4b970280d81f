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
        # the README's sample of that log line has today's fields (its figures aside)
        assert re.search(sample_line_pattern(README.read_text()), done.stdout), done.stdout


def sample_line_pattern(readme: str) -> str:
    """The README's sample summary line of the defragment as a pattern: its text as written, any figure matching."""
    sample = re.search(r"^\[\.\.\.\] (\[INFO\] .*ztriton: ZeRO-3 lp_param_buffer \(defragment\): .*)$", readme, re.M)
    assert sample is not None, "the README shows no sample defragment line"
    return re.sub(r"\d+(\\\.\d+)?", r"\\d+(?:\\.\\d+)?", re.escape(sample.group(1)))


def test_sample_line_pattern_matches_only_the_same_fields():
    readme = ("[...] [INFO] [optimizers.py:133:stage3_defragment] ztriton: ZeRO-3 lp_param_buffer (defragment): "
              "tier=packed, 64.6 KiB in 10.3 ms (0.01 GB/s), peak device n/a, route=torch, tensors=4\n")
    pattern = sample_line_pattern(readme)
    real = ("[2026-12-07 08:36:20,031] [INFO] [optimizers.py:140:stage3_defragment] ztriton: ZeRO-3 lp_param_buffer "
            "(defragment): tier=packed, 7.5 KiB in 2.1 ms (0.00 GB/s), peak device n/a, route=torch, tensors=12")
    assert re.search(pattern, real)
    assert not re.search(pattern, real.replace(" route=torch,", ""))
    assert not re.search(pattern, real.replace("tier=packed", "tier=in place"))


# The README's commands for examples/: each names a script there and only flags that script accepts.
EXAMPLES = README.parent / "examples"
EXAMPLE_BLOCK = re.compile(r"<!-- readme-test: examples -->\n```bash\n(?P<body>.*?)\n```", re.S)
LAUNCHERS = {"deepspeed": {"--num_gpus", "--num_nodes", "--master_port", "--include", "--hostfile"},
             "torchrun": {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--master_port", "--master-port"},
             "accelerate": {"--config_file", "--num_processes", "--main_process_port", "--deepspeed_config_file"}}


def script_parser(script: Path):
    """An argparse parser with the script's own ``add_argument`` calls (read from its source, not run), or, for a
    script that reads ``sys.argv[1:N]`` itself, one with N - 1 positionals and no flags."""
    import argparse
    import ast

    tree = ast.parse(script.read_text())
    parser = argparse.ArgumentParser(prog=script.name, exit_on_error=False)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "add_argument"]
    for call in calls:
        names = [ast.literal_eval(arg) for arg in call.args]
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg in ("default", "action", "nargs")}
        parser.add_argument(*names, **kwargs)
    if not calls:  # sys.argv[1:N]
        (cut,) = [node for node in ast.walk(tree) if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.argv"]
        for i in range(ast.literal_eval(cut.slice.upper) - 1):
            parser.add_argument(f"positional{i}")
    return parser


def example_commands(text: str) -> list[list[str]]:
    import shlex

    (block,) = [m["body"] for m in EXAMPLE_BLOCK.finditer(text)]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [[word for word in words if not re.fullmatch(r"[A-Z_]+=\S*", word)] for words in commands if words]


def test_readme_example_commands_name_real_scripts_and_flags():
    commands = example_commands(README.read_text())
    assert commands[0] == ["cd", "examples"] and len(commands) > 3
    scripts = set()
    for words in commands[1:]:
        launcher, rest = words[0], words[1:]
        if launcher == "accelerate":
            assert rest[0] == "launch", words
            rest = rest[1:]
        assert launcher in LAUNCHERS, f"unknown launcher in {words}"
        (at,) = [i for i, word in enumerate(rest) if word.endswith(".py")][:1]
        for i, word in enumerate(rest[:at]):
            if word.startswith("--"):
                assert word in LAUNCHERS[launcher], f"{launcher} has no {word}: {words}"
                if word in ("--config_file", "--deepspeed_config_file"):
                    assert (EXAMPLES / rest[i + 1]).is_file(), rest[i + 1]
        script = EXAMPLES / rest[at]
        assert script.is_file(), script
        scripts.add(script.name)
        args = script_parser(script).parse_args(rest[at + 1:])  # raises on a flag or argument the script lacks
        for value in vars(args).values():
            if isinstance(value, str) and value.endswith((".json", ".yaml")):
                assert (EXAMPLES / value).is_file(), value
    assert scripts == {p.name for p in EXAMPLES.glob("*.py")}, "every example script has a command in the README"


def test_example_command_check_catches_drift():
    import argparse

    parser = script_parser(EXAMPLES / "trainer_deepspeed.py")
    assert parser.parse_args(["M", "O", "--deepspeed", "ds_zero2.json"]).deepspeed == "ds_zero2.json"
    try:
        parser.parse_args(["M", "O", "--no-such-flag"])
    except (argparse.ArgumentError, SystemExit):
        pass
    else:
        raise AssertionError("an unknown flag parsed")
    accelerate = script_parser(EXAMPLES / "accelerate_train.py")
    assert len(vars(accelerate.parse_args(["M", "O"]))) == 2
    text = "<!-- readme-test: examples -->\n```bash\ncd examples\nX=1 torchrun --nproc_per_node 2 a.py M  # c\n```\n"
    assert example_commands(text) == [["cd", "examples"], ["torchrun", "--nproc_per_node", "2", "a.py", "M"]]
