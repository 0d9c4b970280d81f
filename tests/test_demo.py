"""The demo's output: a short header, one progress line per step and the table; ztriton's per-call lines only with
``--verbose``, and on the CPU they say host memory where it is host memory."""
import logging
import os
import subprocess
import sys


def test_demo_output_is_short_without_verbose(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "ztriton", "demo", "--device", "cpu", "--world-size", "2"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ztriton demo:") and "memory is host memory" in lines[1]
    steps = [line for line in lines if line.startswith(("[1/3]", "[2/3]", "[3/3]"))]
    assert len(steps) == 3 and all(line.endswith("bytes identical") for line in steps), steps
    assert "ztriton:" not in done.stdout and "tier=" not in done.stdout  # no per-call lines
    assert len(lines) <= 20, done.stdout


def test_cpu_lines_say_host_memory_and_quiet_drops_only_our_info():
    from ztriton.integrations.deepspeed.demo import _DropOurInfo, _SayHostMemory

    def record(message, level=logging.INFO):
        return logging.LogRecord("x", level, __file__, 1, message, (), None)

    line = record("ztriton: ZeRO-1/2 flatten, group 0: tier=device, 1 KiB in 1.0 ms, peak device n/a, params=2")
    assert _SayHostMemory().filter(line)
    assert line.getMessage() == ("ztriton: ZeRO-1/2 flatten, group 0: tier=device (host memory), 1 KiB in 1.0 ms, "
                                 "peak n/a, params=2")
    decision = record("ztriton flatten group 0: device -- free %s after headroom", ("20.7 GiB",))
    decision.args = ("20.7 GiB",)
    _SayHostMemory().filter(decision)
    assert decision.getMessage() == "ztriton flatten group 0: device (host memory) -- free 20.7 GiB after headroom"
    quiet = _DropOurInfo()
    assert not quiet.filter(record("ztriton: zero.Init: tier=sharded init"))
    assert quiet.filter(record("ztriton: a warning", logging.WARNING))
    assert quiet.filter(record("DeepSpeed's own line"))
