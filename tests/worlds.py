"""The tests' worlds: :mod:`ztriton.testing` under the names the test modules import."""
from ztriton.testing import DEEPSPEED_CPU_ENV, WorldError, fake_world, run_world, teardown

__all__ = ["DEEPSPEED_CPU_ENV", "WorldError", "fake_world", "run_world", "teardown"]
