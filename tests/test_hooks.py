"""ztriton's hooks go in whatever the import order: availability probes first (transformers' and accelerate's
``find_spec`` / ``importlib.metadata``), DeepSpeed before or after ztriton, transformers or accelerate first,
spawned and forked workers. Each case is a fresh interpreter started as a user's would be (the installed
start-up hook runs unless the case turns it off)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

REPORT = """
import json, sys
def _report(**extra):
    from ztriton.integrations.deepspeed import install
    hf = sys.modules.get("ztriton.integrations.transformers")
    print("REPORT " + json.dumps({"deepspeed": install.installed(),
                                   "transformers": None if hf is None else hf.installed(), **extra}))
"""


def _run(body: str, *, autoload: bool = True, timeout: float = 240) -> dict:
    env = {**os.environ, "ZTRITON_AUTOLOAD": "1" if autoload else "0", "DS_ACCELERATOR": "cpu",
           "TRITON_INTERPRET": "1"}
    code = REPORT + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line[len("REPORT "):])


def test_availability_probes_before_the_imports_leave_the_hooks_to_install():
    """transformers' is_deepspeed_available and accelerate's probe with find_spec and importlib.metadata first;
    the later real imports still install both integrations."""
    report = _run("""
        import importlib.util, importlib.metadata
        assert importlib.util.find_spec("deepspeed") is not None
        importlib.metadata.metadata("deepspeed"); importlib.metadata.version("deepspeed")
        assert importlib.util.find_spec("transformers.modeling_utils") is not None
        import deepspeed, transformers.modeling_utils
        _report()
    """)
    assert report == {"deepspeed": True, "transformers": True}


def test_transformers_and_accelerate_first_as_trainer_and_accelerate_launch_do():
    report = _run("""
        import accelerate.utils, transformers
        from transformers.integrations import is_deepspeed_available
        assert is_deepspeed_available() and accelerate.utils.is_deepspeed_available()
        from transformers import AutoModelForCausalLM  # the lazy module: modeling_utils loads here
        import transformers.modeling_utils
        from accelerate.utils import DeepSpeedPlugin  # accelerate imports deepspeed lazily, after its probes
        import deepspeed
        _report()
    """)
    assert report == {"deepspeed": True, "transformers": True}


def test_deepspeed_imported_before_ztriton_without_the_start_up_hook():
    report = _run("""
        import sys, deepspeed, transformers.modeling_utils
        assert "ztriton" not in sys.modules
        import ztriton
        _report()
    """, autoload=False)
    assert report == {"deepspeed": True, "transformers": True}


def test_a_probe_that_finds_nothing_then_a_later_import_in_spawned_and_forked_workers():
    """The parent probes only; a spawned worker (a new interpreter: the start-up hook) and a forked one (the
    parent's meta path, probed but never imported) each install the hooks when they import DeepSpeed."""
    report = _run_file("""
        import importlib.util, multiprocessing as mp
        importlib.util.find_spec("deepspeed")

        def child(queue):
            import deepspeed
            from ztriton.integrations.deepspeed import install
            queue.put(install.installed())

        if __name__ == "__main__":
            results = {}
            for method in ("spawn", "fork"):
                context = mp.get_context(method)
                queue = context.Queue()
                worker = context.Process(target=child, args=(queue,))
                worker.start()
                results[method] = queue.get(timeout=200)
                worker.join()
            import sys
            print("REPORT " + json.dumps({"parent_imported": "deepspeed" in sys.modules, **results}))
    """)
    assert report == {"parent_imported": False, "spawn": True, "fork": True}


def _run_file(body: str, timeout: float = 300) -> dict:
    """As :func:`_run`, from a script file: spawned workers re-import their target from ``__main__``'s file."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "case.py")
        with open(script, "w") as handle:
            handle.write("import json\n" + textwrap.dedent(body))
        env = {**os.environ, "ZTRITON_AUTOLOAD": "1", "DS_ACCELERATOR": "cpu", "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line[len("REPORT "):])


def test_a_failed_import_leaves_the_hook_for_the_next_try(tmp_path):
    """An import of DeepSpeed that raises (here: a stand-in package whose first import fails) keeps the hook
    waiting; the import that succeeds installs into that module."""
    package = tmp_path / "deepspeed"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import os\n"
        "if not os.environ.get('SECOND_TRY'):\n"
        "    os.environ['SECOND_TRY'] = '1'\n"
        "    raise ImportError('first try fails')\n"
        "LOADED = True\n")
    code = REPORT + textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import ztriton
        try:
            import deepspeed
        except ImportError:
            pass
        waiting = [f.name for f in sys.meta_path if type(f).__name__ == "_InstallOnImport"]
        calls = []
        import ztriton as z
        z._install_hooks = lambda name: calls.append(name)
        import deepspeed
        print("REPORT " + json.dumps({{"waiting": waiting, "installed_into": calls, "loaded": deepspeed.LOADED}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ZTRITON_AUTOLOAD": "0"})
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert json.loads(line[len("REPORT "):]) == {"waiting": ["transformers.modeling_utils", "deepspeed"],
                                                  "installed_into": ["deepspeed"], "loaded": True}
