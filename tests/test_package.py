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
    assert origin == "none" or not origin.startswith(os.path.join(repo, "kernels")), f"`import kernels` is ours: {origin}"


def test_demo_runs_on_cpu_and_reports_identical_bytes(tmp_path):
    import json

    done = run_python(["-m", "ztriton", "demo", "--device", "cpu", "--world-size", "3", "--json", "demo.json",
                       "--verbose"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    table = done.stdout.split("\n\n")[-2]
    written = json.loads((tmp_path / "demo.json").read_text())  # --json: the same rows, as printed
    assert written["world_size"] == 3 and [r["bytes"] for r in written["rows"]] == ["identical"] * 3
    for row in written["rows"]:
        assert f"{row['key_off_s'] * 1e3:8.1f}" in table and f"{row['key_on_s'] * 1e3:8.1f}" in table  # printed in ms
    for step in ("ZeRO-3 zero.Init", "ZeRO-3 initialize (lp_param_buffer)", "ZeRO-2 initialize (flatten)"):
        assert step in table
    assert "DIFFERENT" not in done.stdout and table.count("identical") == 3
    # with the key on, the fused experts started in host memory and ztriton built every buffer
    for line in ("zero.Init partitions through ztriton", "ztriton defragment of", "ztriton flatten group 0: device"):
        assert line in done.stdout


def test_demo_on_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # the error path exists only without CUDA
    done = run_python(["-m", "ztriton", "demo", "--device", "cuda"], tmp_path)
    assert done.returncode == 2
    assert "--device cuda" in done.stderr and "no CUDA device" in done.stderr and "--device cpu" in done.stderr
    assert "Traceback" not in done.stderr


def test_demo_output_has_no_foreign_warnings(tmp_path):
    done = run_python(["-W", "default", "-m", "ztriton", "demo", "--device", "cpu", "--world-size", "2", "--verbose"],
                      tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout + done.stderr
    for noise in ("Warning:", "untested optimizer", "is deprecated"):
        assert noise not in text, text
    assert "[INFO] [optimizers.py:" in done.stdout  # ztriton's lines through DeepSpeed's logger still show


def test_wheel_ships_the_start_up_hook_at_the_top_of_site_packages(tmp_path):
    import shutil
    import zipfile
    from pathlib import Path

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # From a copy without build/: setuptools would otherwise ship what an earlier build left there.
    source = tmp_path / "source"
    for folder in ("ztriton", "kernels", "tools"):
        shutil.copytree(os.path.join(repo, folder), source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(repo, name), source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("ztriton-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ztriton-autoload.pth" in names and "ztriton/__init__.py" in names and "ztriton/kernels/__init__.py" in names
    hook = zipfile.ZipFile(wheel).read("ztriton-autoload.pth").decode()
    with open(os.path.join(repo, "tools", "ztriton-autoload.pth")) as handle:
        assert hook == handle.read()
    assert not [n for n in names if n.startswith(("tools/", "tests/", "kernels/"))]
    # Every module of the checkout, in the wheel (pyproject lists the packages one by one: a new subpackage left
    # out of it imports from the checkout and breaks every pip install).
    root = Path(repo)
    modules = {p.relative_to(root).as_posix() for p in (root / "ztriton").rglob("*.py")}
    modules |= {"ztriton/" + p.relative_to(root).as_posix() for p in (root / "kernels").rglob("*.py")}
    assert modules - set(names) == set(), "modules missing from the wheel (add their package to pyproject)"


def test_editable_install_ships_the_start_up_hook(tmp_path):
    """A fresh venv reusing this environment's packages (no torch reinstall): ``pip install -e`` of the
    checkout puts the hook beside setuptools' own editable finder, and it runs at start-up."""
    import site
    import venv

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    (python,) = (tmp_path / "venv" / "bin").glob("python3")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-build-isolation", "-e", repo], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(site.getsitepackages())})
    assert done.returncode == 0, done.stderr
    installed = sorted(os.listdir(purelib))
    assert "ztriton-autoload.pth" in installed and any(n.startswith("__editable__.ztriton") for n in installed)
    probe = "import sys; print('ztriton' in sys.modules, sys.modules['ztriton'].__file__)"
    for flag, loaded in (("1", "True"), ("0", "False")):
        ran = subprocess.run([str(python), "-c", probe if flag == "1" else "import sys; print('ztriton' in sys.modules)"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={**os.environ, "ZTRITON_AUTOLOAD": flag})
        assert ran.stdout.split()[0] == loaded, ran.stdout + ran.stderr
    assert ran.returncode == 0


def test_installing_into_this_environment_changes_no_other_package(tmp_path):
    """``pip install .`` into an environment that already has a supported stack (CI's newest: torch 2.15,
    transformers 5.25, DeepSpeed 0.19.8) installs ztriton and nothing else: no downgrade, no new package.
    Offline (--no-index): a requirement this environment does not satisfy fails the resolution here."""
    import json

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "-q", "--report", str(report), repo], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PIP_CONSTRAINT": os.devnull, "PIP_CONFIG_FILE": os.devnull})
    assert done.returncode == 0, done.stdout + done.stderr
    planned = [(item["metadata"]["name"], item["metadata"]["version"]) for item in json.loads(report.read_text())["install"]]
    assert [name for name, _ in planned] == ["ztriton"], planned


def test_checkout_root_hands_the_name_kernels_to_another_distribution(tmp_path):
    """From the checkout root (``python -m pytest``, ``PYTHONPATH=.``) the folder kernels/ is found first as the
    top-level ``kernels``; where another distribution provides ``kernels`` (transformers 5.25 imports PyPI's),
    that one is what ``import kernels`` returns, submodules included, and ``ztriton.kernels`` is still ours."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'the other kernels'\n")
    (other / "layers.py").write_text("WHERE = 'the other kernels.layers'\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from kernels import CUDAProperties; import kernels.layers, ztriton.kernels as ours; "
            "print(CUDAProperties); print(kernels.layers.WHERE); print(ours.pack.__module__)")
    done = run_python(["-c", code], repo, {"PYTHONPATH": os.pathsep.join([repo, str(tmp_path / "site")])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the other kernels", "the other kernels.layers", "ztriton.kernels.ops"]
