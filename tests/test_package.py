"""The installed package: import names, and the README's demo command end to end on the CPU."""
import os
import subprocess
import sys


def run_python(code_or_args, cwd, env_extra=None):
    env = {**os.environ, "TRITON_INTERPRET": "1", **(env_extra or {})}
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_kernels_install_as_ztriton_kernels_only(tmp_path):
    """`ztriton.kernels` imports from anywhere; the top-level name `kernels` is not ours (PyPI has one)."""
    done = run_python("import ztriton.kernels as k; print(k.__name__); print(k.copy_chunk.__module__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ztriton.kernels", "ztriton.kernels.ops"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = run_python("import importlib.util as u, ztriton; s = u.find_spec('kernels'); "
                       "print('none' if s is None else s.origin)", tmp_path)
    assert probe.returncode == 0, probe.stderr
    origin = probe.stdout.strip()
    assert origin == "none" or not origin.startswith(repo), f"`import kernels` resolves to ours: {origin}"


def test_demo_runs_on_cpu_and_reports_identical_bytes(tmp_path):
    done = run_python(["-m", "ztriton", "demo", "--device", "cpu", "--world-size", "3"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("\n\n")[-2]
    for step in ("ZeRO-3 zero.Init", "ZeRO-3 initialize (lp_param_buffer)", "ZeRO-2 initialize (flatten)"):
        assert step in table
    assert "DIFFERENT" not in done.stdout and table.count("identical") == 3
    # with the key on, the fused experts started in host memory and ztriton built every buffer
    for line in ("zero.Init partitions through ztriton", "ztriton defragment of", "ztriton flatten group 0: device"):
        assert line in done.stdout
