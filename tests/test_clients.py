"""The key through the real clients: HF Trainer, ``accelerate launch``, the ``deepspeed`` launcher and ``torchrun``.

Each run executes a recipe of examples/ exactly as a user would (the launcher, the script, its DeepSpeed config), on
2 CPU ranks joined by gloo, with a tiny Llama or Mixtral checkpoint that this module writes. Key on is the recipe's
config as shipped; key off is the same config without ``"partition_backend"`` (the plain script's
``PARTITION_BACKEND=torch``). Every (client, model, key) runs once per module, producing all that the tests compare:
each rank's output, the per-step losses, the saved model and the ZeRO checkpoint.

tests/clients/sitecustomize.py (on the runs' PYTHONPATH) adapts only what a CPU machine changes: accelerate's
backend choice without an accelerator, DeepSpeed's shared-memory op build, and each rank's output to its own files.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hf_models

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLIENT_SHIM = Path(__file__).resolve().parent / "clients"
BIN = Path(sys.executable).parent  # this environment's deepspeed, torchrun and accelerate
WORLD = 2
STEPS = 4
# What rank 0 says with the key, each line once: the banner of each step ztriton takes over, then its summary.
ZERO3_LINES = ("ztriton: zero.Init:", "from_pretrained under ZeRO-3 reads each rank's own slices",
               "ztriton: from_pretrained (shard-on-read):", "flat partition buffer is built by ztriton.defragment",
               "ztriton: ZeRO-3 lp_param_buffer (defragment):")
# The Trainer gives the optimizer two groups (with and without weight decay): one flatten each.
ZERO2_LINES = ("init-time flatten goes through ztriton.flatten_groups", "ztriton: ZeRO-1/2 flatten, group 0:",
               "ztriton: ZeRO-1/2 flatten, group 1:")
# Mixtral's experts run through grouped_mm, which needs 16-byte strides: intermediate 16 instead of hf_models' 13.
# Three layers: the ZeRO-2 flatten's first group then holds more params than Tuning.torch_pieces (16), so that every
# client's key-on run launches the Triton kernels (KERNEL_JOBS).
CHECKPOINT_OVERRIDES = {"llama": {"num_hidden_layers": 3}, "mixtral": {"intermediate_size": 16, "num_hidden_layers": 3}}
# The summaries of the jobs of more than Tuning.torch_pieces pieces in these models: the Triton kernels copy them
# (from_pretrained's jobs here are each param's few checkpoint slices: torch's copies).
KERNEL_JOBS = ("ZeRO-1/2 flatten, group 0:", "ZeRO-3 lp_param_buffer (defragment):")


@dataclass(frozen=True)
class Client:
    launcher: str  # "deepspeed", "torchrun" or "accelerate"
    script: str
    config: str | None  # the recipe's DeepSpeed config file (None: the script holds its config)
    summaries: tuple[str, ...]  # the lines rank 0 prints with the key


CLIENTS = {
    "trainer_zero3": Client("deepspeed", "trainer_deepspeed.py", "ds_zero3.json", ZERO3_LINES),
    "trainer_zero2": Client("torchrun", "trainer_deepspeed.py", "ds_zero2.json", ZERO2_LINES),
    "accelerate": Client("accelerate", "accelerate_train.py", "ds_zero3.json", ZERO3_LINES),
    "deepspeed_script": Client("torchrun", "deepspeed_from_pretrained.py", None, ZERO3_LINES),
}
CASES = [("trainer_zero3", "llama"), ("trainer_zero3", "mixtral"), ("trainer_zero2", "llama"),
         ("trainer_zero2", "mixtral"), ("accelerate", "llama"), ("accelerate", "mixtral"),
         ("deepspeed_script", "mixtral")]


@dataclass
class Run:
    client: str
    output_dir: Path
    launcher_output: str
    rank_output: dict[int, str]  # stdout and stderr of each rank

    def lines(self, rank: int | None = None) -> list[str]:
        text = self.launcher_output if rank is None else self.rank_output[rank]
        return [line for line in text.splitlines() if "ztriton:" in line]


# ----------------------------------------------------------------------------------------- running the recipes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config_file(client: Client, key: bool, directory: Path) -> Path | None:
    """The recipe's config with the key, or a copy without it (the recipe must ship the key on)."""
    if client.config is None:
        return None
    recipe = EXAMPLES / client.config
    config = json.loads(recipe.read_text())
    assert config.pop("partition_backend") == "triton", f"{recipe} ships without the key"
    if key:
        return recipe
    off = directory / f"off_{client.config}"
    off.write_text(json.dumps(config))
    return off


def _command(client: Client, config: Path | None, model: Path, output_dir: Path, port: int,
             resume: Path | None) -> list[str]:
    script_args = [str(model), str(output_dir)]
    if client.launcher == "accelerate":
        return [str(BIN / "accelerate"), "launch", "--config_file", "accelerate_deepspeed.yaml",
                "--num_processes", str(WORLD), "--main_process_port", str(port),
                "--deepspeed_config_file", config.name if config.parent == EXAMPLES else str(config),
                client.script, *script_args]
    if config is not None:
        script_args += ["--deepspeed", config.name if config.parent == EXAMPLES else str(config)]
    if resume is not None:
        script_args += ["--resume", str(resume)]
    if client.launcher == "deepspeed":
        launcher = [str(BIN / "deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(port)]
    else:
        launcher = [str(BIN / "torchrun"), "--nproc_per_node", str(WORLD), "--master_port", str(port)]
    return [*launcher, client.script, *script_args]


def _environment(key: bool, rank_dir: Path) -> dict[str, str]:
    """The caller's environment minus any world or accelerate state it may hold, on CPU ranks."""
    dropped = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ZTRITON_AUTOLOAD",
               "PYTHONPATH", "PARTITION_BACKEND"}
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("ACCELERATE_")}
    env.update(DS_ACCELERATOR="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(CLIENT_SHIM), ZTRITON_TEST_RANK_OUTPUT=str(rank_dir),
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if not key:
        env["PARTITION_BACKEND"] = "torch"  # the plain script's switch; the config files drop the key instead
    return env


GLOO_EXIT_ABORT = "terminate called without an active exception"


def launch(name: str, model: Path, key: bool, directory: Path, resume: Path | None = None) -> Run:
    """Run the recipe; a run whose rank aborted at exit with gloo's message is repeated once, whole, in a fresh
    folder: everything the tests read comes from the repeat. The recipes wait for every rank before exit, which
    removed the abort in our loops (bench/NOTES.md, "Client runs that aborted at exit"); the repeat stays for
    launchers' own teardown, which the recipes do not control."""
    for attempt in range(2):
        if attempt:
            shutil.rmtree(directory)
        done, run = _launch_once(name, model, key, directory, resume)
        if done.returncode == 0 or not any(GLOO_EXIT_ABORT in text for text in run.rank_output.values()):
            break
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stdout}\n{done.stderr}\n" + "\n".join(
        f"--- rank {rank}\n{text[-6000:]}" for rank, text in run.rank_output.items())
    return run


def _launch_once(name: str, model: Path, key: bool, directory: Path, resume: Path | None):
    client = CLIENTS[name]
    rank_dir = directory / "ranks"
    rank_dir.mkdir(parents=True)
    command = _command(client, _config_file(client, key, directory), model, directory / "output", _free_port(),
                       resume)
    done = subprocess.run(command, cwd=EXAMPLES, env=_environment(key, rank_dir), capture_output=True, text=True,
                          timeout=600)
    ranks = {rank: _read(rank_dir / f"rank{rank}.out") + _read(rank_dir / f"rank{rank}.err") for rank in range(WORLD)}
    return done, Run(name, directory / "output", done.stdout + done.stderr, ranks)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: hf_models.save_checkpoint(name, root / name, **CHECKPOINT_OVERRIDES[name])
            for name in CHECKPOINT_OVERRIDES}


class Runs:
    """Each (client, model, key[, resumed from]) launched once per module, on first request; a run that failed
    fails every later request with its first message instead of launching again."""

    def __init__(self, root: Path, checkpoints: dict[str, Path]):
        self.root, self.checkpoints, self.done = root, checkpoints, {}

    def get(self, client: str, model: str, key: bool) -> Run:
        return self._once((client, model, key), f"{client}-{model}-{_on(key)}", None)

    def resumed(self, client: str, model: str, key: bool, saved_with: bool) -> Run:
        """A run with ``key`` that resumes the checkpoint of step 2 of the run with ``saved_with``."""
        checkpoint = self.get(client, model, saved_with).output_dir / "checkpoint-2"
        return self._once((client, model, key, saved_with), f"{client}-{model}-{_on(key)}-resumes-{_on(saved_with)}",
                          checkpoint)

    def _once(self, ident: tuple, folder: str, resume: Path | None) -> Run:
        if ident not in self.done:
            client, model, key = ident[:3]
            try:
                self.done[ident] = launch(client, self.checkpoints[model], key, self.root / folder, resume)
            except AssertionError as failure:
                self.done[ident] = failure
        if isinstance(self.done[ident], AssertionError):
            pytest.fail(f"the run {folder} failed (once, for every test that uses it):\n{self.done[ident]}")
        return self.done[ident]


def _on(key: bool) -> str:
    return "on" if key else "off"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, checkpoints) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), checkpoints)


# -------------------------------------------------------------------------------------------- reading a run


def losses(run: Run) -> dict[int, float]:
    """Step -> training loss: the Trainer's log history, or the ``step N: loss X`` lines rank 0 prints."""
    if run.client.startswith("trainer"):
        state = json.loads((run.output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
        return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}
    found = re.findall(r"^step (\d+): loss (\S+)$", run.rank_output[0], re.M)
    return {int(step): float(loss) for step, loss in found}


def float_bits(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).view(torch.int64)


def assert_same_losses(got: dict[int, float], expected: dict[int, float], steps: list[int]) -> None:
    assert set(steps) <= set(got) and set(steps) <= set(expected), (got, expected)
    assert torch.equal(float_bits([got[s] for s in steps]), float_bits([expected[s] for s in steps])), (got, expected)


def zero_checkpoint(run: Run) -> Path:
    """The folder holding the run's last ZeRO checkpoint (its ``latest`` file names the step's subfolder)."""
    return {"accelerate": run.output_dir / "checkpoint", "deepspeed_script": run.output_dir}.get(
        run.client, run.output_dir / f"checkpoint-{STEPS}")


def consolidated(run: Run) -> dict[str, torch.Tensor]:
    """zero_to_fp32's state dict of the run's ZeRO checkpoint (DeepSpeed's own offline consolidation)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(zero_checkpoint(run)))
    return {name: tensor.contiguous() for name, tensor in state.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (a NaN equals the same NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


# The files save_model / save_pretrained writes at the top of the output folder; training_args.bin pickles the
# run's own arguments (its output folder and config path among them), so it differs between any two runs.
RUN_SPECIFIC = {"training_args.bin"}


def saved_model_files(run: Run) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(run.output_dir.iterdir())
            if path.is_file() and path.name not in RUN_SPECIFIC}


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("client,model", CASES)
def test_summary_lines_on_rank0_only_with_the_key(runs, client, model):
    on, off = runs.get(client, model, True), runs.get(client, model, False)
    rank0 = on.lines(0)
    for summary in CLIENTS[client].summaries:
        assert sum(summary in line for line in rank0) == 1, (summary, rank0)
    assert on.lines(1) == [] and on.lines() == [], (on.lines(1), on.lines())
    assert [off.lines(rank) for rank in (0, 1, None)] == [[], [], []]


@pytest.mark.parametrize("client,model", CASES)
def test_the_triton_kernels_run_in_every_client(runs, client, model):
    rank0 = runs.get(client, model, True).lines(0)
    jobs = [line for line in rank0 if any(job in line for job in KERNEL_JOBS)]
    assert len(jobs) == 1, rank0
    launches = re.search(r"route=triton, launches=(\d+)", jobs[0])
    assert launches is not None and int(launches.group(1)) > 0, jobs[0]


@pytest.mark.parametrize("client,model", CASES)
def test_losses_bit_identical_key_on_and_off(runs, client, model):
    on, off = losses(runs.get(client, model, True)), losses(runs.get(client, model, False))
    assert sorted(on) == sorted(off) == list(range(1, STEPS + 1)), (on, off)
    assert all(torch.isfinite(torch.tensor(list(on.values())))), on
    assert_same_losses(on, off, list(range(1, STEPS + 1)))


@pytest.mark.parametrize("client,model", [case for case in CASES if case[0] != "deepspeed_script"])
def test_saved_model_byte_identical_key_on_and_off(runs, client, model):
    on, off = saved_model_files(runs.get(client, model, True)), saved_model_files(runs.get(client, model, False))
    assert "model.safetensors" in on and "config.json" in on, sorted(on)
    assert sorted(on) == sorted(off)
    assert [name for name in on if on[name] != off[name]] == []


@pytest.mark.parametrize("client,model", CASES)
def test_zero_to_fp32_bit_identical_key_on_and_off(runs, client, model):
    on, off = consolidated(runs.get(client, model, True)), consolidated(runs.get(client, model, False))
    assert on and sorted(on) == sorted(off)
    assert [name for name in on if not same_bits(on[name], off[name])] == []


@pytest.mark.parametrize("key,saved_with", [(False, True), (True, False)], ids=["off-resumes-on", "on-resumes-off"])
def test_checkpoint_resumes_across_the_key(runs, key, saved_with):
    """A Trainer checkpoint of step 2 saved with the key on (off) resumes with it off (on): steps 3 and 4 and the
    final model are those of the runs that never stopped."""
    client, model = "trainer_zero3", "mixtral"
    resumed = runs.resumed(client, model, key, saved_with)
    for uninterrupted in (runs.get(client, model, key), runs.get(client, model, saved_with)):
        assert_same_losses(losses(resumed), losses(uninterrupted), [3, 4])
        files = saved_model_files(resumed)
        assert "model.safetensors" in files and files == saved_model_files(uninterrupted)
