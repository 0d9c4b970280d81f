"""The layering of docs/architecture.md is a checked contract: the import-linter contracts in
pyproject.toml hold on the tree, and a back-arrow breaks them."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[test]')")


def lint(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: the packages under `root` are the ones analysed, not the installed checkout.
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)})


def test_contracts_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, back_arrow, contract", [
    ("ztriton/policy.py", "import ztriton.flatten", "imports run one way"),
    ("ztriton/memory.py", "import ztriton.integrations.deepspeed.state", "imports run one way"),
    ("ztriton/flatten/tiers.py", "import deepspeed", "only ztriton.integrations imports deepspeed"),
    ("kernels/plan.py", "import ztriton.layout", "kernels know nothing of ztriton"),
])
def test_a_back_arrow_breaks_a_contract(tmp_path, module, back_arrow, contract):
    for name in ("ztriton", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{back_arrow}  # a back-arrow\n")
    done = lint(tmp_path)
    assert done.returncode != 0, done.stdout[-4000:]
    summary = " ".join(done.stdout.split())  # the report wraps long contract names
    after = summary[summary.index(contract):]
    assert after.index("BROKEN") < after.index("KEPT") if "KEPT" in after else "BROKEN" in after, done.stdout[-4000:]
