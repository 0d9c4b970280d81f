"""How often a client recipe's rank aborts at exit ("terminate called without an active exception").

Runs the HF Trainer recipe (torchrun, 2 gloo ranks on the CPU, ZeRO-3, tiny Llama, key off) N times through
``tests/test_clients.py``'s launcher, without its repeat, and prints each run's exit status and aborted ranks.

    python bench/probes/probe_client_exit.py [N]      # from the project root, in a venv with the test extras
"""
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import hf_models  # noqa: E402
import test_clients  # noqa: E402


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    root = Path(tempfile.mkdtemp(prefix="client_exit_"))
    checkpoint = hf_models.save_checkpoint("llama", root / "llama", **test_clients.CHECKPOINT_OVERRIDES["llama"])
    aborted_runs = 0
    for index in range(runs):
        folder = root / f"run{index}"
        done, run = test_clients._launch_once("trainer_zero3", checkpoint, False, folder, None)
        aborted = [rank for rank, text in run.rank_output.items() if test_clients.GLOO_EXIT_ABORT in text]
        aborted_runs += bool(aborted)
        print(f"run {index}: exit status {done.returncode}, ranks aborted at exit {aborted}", flush=True)
        shutil.rmtree(folder)
    print(f"{aborted_runs} of {runs} runs aborted at exit", flush=True)
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
