"""The DeepSpeed config key ``"partition_backend": "triton"`` (ztriton/deepspeed.py), end to end.

Key on versus key off must give the same bytes: zero.Init partitions, ZeRO-1/2/3 training losses and
final parameters, the stage-3 optimizer's ``lp_param_buffer``. Simulated ranks run on torch's fake
process group (collectives move no data, so each rank's results depend only on its own rank), real
values that travel between ranks on gloo worlds of two processes.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import subprocess
import sys

import pytest
import torch

import deepspeed
from ds_reference import BitsModule, bits, bits_tensor, dtype_config, gloo_safe_gathers, zero3_reference
from ztriton.integrations.deepspeed import config as integration
from ztriton.integrations.deepspeed import init_context, report
from ztriton.integrations.deepspeed.state import STATE
from ztriton.policy import Options
from ztriton.layout import zero3_slice

SHAPES = [(5, 7), (3,), (64, 33), (2, 3, 4), (1,)]


def config(backend: str | None, stage: int = 3, dtype: torch.dtype = torch.bfloat16, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, **dtype_config(dtype), **extra}
    if backend is not None:
        cfg["partition_backend"] = backend
    return cfg


def valid_prefix(param: torch.nn.Parameter, rank: int) -> torch.Tensor:
    """Bits of the part of this rank's partition that holds values (DeepSpeed leaves the pad unset)."""
    sl = zero3_slice(param.ds_numel, param.ds_process_group.size())
    return bits(param.ds_tensor)[:sl.valid_numel(rank)]


# ---------------------------------------------------------------------------------------------- install


def test_import_installs_hooks_once_whichever_is_imported_first(tmp_path):
    """Eleven functions wrapped once, whichever is imported first; uninstall puts DeepSpeed's own back. The
    stage-3 optimizer's defragment is wrapped where this DeepSpeed has it: a function of stage3 (from
    zero.utils), or a staticmethod of DeepSpeedZeroOptimizer_Stage3 that stays one."""
    script = (
        "import os, sys; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
        "first = sys.argv[1]\n"
        "import importlib; importlib.import_module(first)\n"
        "import ztriton, deepspeed\n"
        "from ztriton.integrations.deepspeed import install as d\n"
        "from ztriton.integrations.deepspeed.state import STATE\n"
        "from deepspeed.runtime.zero import partition_parameters as pp, stage3\n"
        "static = isinstance(vars(stage3.DeepSpeedZeroOptimizer_Stage3).get('defragment'), staticmethod)\n"
        "assert hasattr(stage3, 'defragment') != static  # exactly one of the two\n"
        "owner = stage3.DeepSpeedZeroOptimizer_Stage3 if static else stage3\n"
        "home = 'deepspeed.runtime.zero.stage3' if static else 'deepspeed.runtime.zero.utils'\n"
        "n = len(STATE.originals); init = pp.Init.__init__; defrag = vars(owner)['defragment']\n"
        "d.install(); d.install()\n"
        "assert d.installed() and len(STATE.originals) == n == 11, n\n"
        "assert pp.Init.__init__ is init and vars(owner)['defragment'] is defrag  # not wrapped twice\n"
        "assert isinstance(defrag, staticmethod) == static\n"
        "assert owner.defragment.__wrapped__.__module__ == home\n"
        "d.uninstall(); restored = vars(owner)['defragment']\n"
        "assert isinstance(restored, staticmethod) == static and owner.defragment.__module__ == home\n"
        "assert not hasattr(owner.defragment, '__wrapped__')\n"
        "assert '_add_tensor_creation_wrappers' not in vars(pp.Init)  # inherited again, as before\n"
        "print('ok')\n")
    for first in ("ztriton", "deepspeed"):
        done = subprocess.run([sys.executable, "-c", script, first], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_settings_from_dict_path_base64_and_deepspeed_config(tmp_path, fake_world):
    import base64

    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = config("triton", ztriton={"sharded_init_bytes": 4096, "chunk_bytes": 1 << 20})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    with fake_world(2, 0):
        ds_config = DeepSpeedConfig(cfg)
    expected = integration.Settings("triton", Options.of(sharded_init_bytes=4096, chunk_bytes=1 << 20))
    for source in (cfg, str(path), path, encoded, ds_config):
        assert integration.settings_from(source) == expected
    with pytest.raises(ValueError, match="'partition_backend' must be one of"):  # DeepSpeedConfig checks the key itself
        DeepSpeedConfig({**cfg, "partition_backend": "tritonn"})
    assert integration.settings_from(None) == integration.Settings("torch")
    assert integration.settings_from(config(None)).backend == "torch"


def test_renamed_option_is_read_with_a_warning():
    """The section's old name ``host_init_bytes`` still sets ``sharded_init_bytes`` for one release, with a
    warning a user sees (FutureWarning); both names with different values is an error naming both."""
    with pytest.warns(FutureWarning, match="'host_init_bytes' is now 'sharded_init_bytes'"):
        old = integration.settings_from({"partition_backend": "triton", "ztriton": {"host_init_bytes": 4096}})
    assert old.options.sharded_init_bytes == 4096
    assert old == integration.settings_from({"partition_backend": "triton", "ztriton": {"sharded_init_bytes": 4096}})
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="sharded_init_bytes=8192 and its old name "
                                                                       "host_init_bytes=4096 differ"):
        integration.settings_from({"ztriton": {"host_init_bytes": 4096, "sharded_init_bytes": 8192}})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['host_init'\]"):
        Options.of(host_init=1)


@pytest.mark.parametrize("bad, match", [
    ({"partition_backend": "trition"}, r"'partition_backend' must be one of \['torch', 'triton'\], got 'trition'"),
    ({"partition_backend": None}, "must be one of"),
    ({"partition_backend": "triton", "ztriton": {"host_init": 1}}, r"unknown 'ztriton' option\(s\) \['host_init'\]"),
    ({"partition_backend": "triton", "ztriton": {"chunk_bytes": -1}}, r"ztriton.chunk_bytes must be an int >= 0"),
    ({"partition_backend": "triton", "ztriton": [1]}, "must be a dict"),
    ({"partition_backend": "triton", "ztriton": {"chunk_bytes": 4096}}, r"ztriton.chunk_bytes=4096 is below the minimum of 1048576"),
])
def test_bad_config_raises_at_initialize_and_zero_init(fake_world, bad, match):
    cfg = {**config(None, stage=2), **bad}
    with fake_world(2, 0):
        model = torch.nn.Linear(4, 4).bfloat16()
        with pytest.raises(ValueError, match=match):
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        with pytest.raises(ValueError, match=match):
            deepspeed.zero.Init(config_dict_or_path=cfg)


# ---------------------------------------------------------------------------------------------- zero.Init


@pytest.mark.parametrize("world_size, ranks", [(1, [0]), (3, [0, 2]), (8, [5, 7])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wrap_existing", [False, True])
def test_zero_init_key_on_matches_key_off(world_size, ranks, dtype, wrap_existing):
    """Under the key, zero.Init (context and module=) leaves the same params, bit for bit."""
    for rank in ranks:
        off = zero3_reference(lambda: BitsModule(SHAPES, seed=3), world_size, rank, dtype, wrap_existing=wrap_existing)
        on = zero3_reference(lambda: BitsModule(SHAPES, seed=3), world_size, rank, dtype, wrap_existing=wrap_existing,
                             config={"partition_backend": "triton", "ztriton": {"sharded_init_bytes": 256}})
        for a, b in zip(off, on, strict=True):
            assert (a.name, a.ds_shape, a.ds_numel, a.ds_numel_aligned, a.partition_numel, a.data_numel, a.status) == \
                   (b.name, b.ds_shape, b.ds_numel, b.ds_numel_aligned, b.partition_numel, b.data_numel, b.status)
            valid = zero3_slice(a.ds_numel, world_size).valid_numel(rank)
            assert torch.equal(bits(a.partition)[:valid], bits(b.partition)[:valid]), (a.name, rank)
            assert not bits(b.partition)[valid:].any(), "ztriton's partition padding is zeros"


class Experts(torch.nn.Module):
    """A fused-expert tensor beside small layers, created with DeepSpeed's patched constructors."""

    def __init__(self, experts=8, width=16):
        super().__init__()
        self.router = torch.nn.Linear(width, experts, bias=False)
        self.experts = torch.nn.Parameter(torch.empty(experts, width, 4 * width))
        torch.nn.init.uniform_(self.experts, -0.1, 0.1)
        self.norm = torch.nn.LayerNorm(width)


class TwoGroups(torch.nn.Module):
    """A param partitioned over the whole world beside one over an expert-parallel subgroup (DeepSpeed's
    ``ds_zero_partition_process_group``), each below and above the placeholder threshold."""

    def __init__(self, subgroup):
        super().__init__()
        for name, numel in (("shared", 10), ("expert", 10), ("big_shared", 300), ("big_expert", 300)):
            param = torch.nn.Parameter(torch.empty(numel))
            if "expert" in name:
                param.ds_zero_partition_process_group = subgroup
            torch.nn.init.normal_(param)
            self.register_parameter(name, param)


def test_params_of_two_partition_groups_in_one_init(fake_world):
    """Each param is partitioned over the group DeepSpeed gives it: over 4 ranks, or, on a DeepSpeed that honours
    a param's ``ds_zero_partition_process_group``, over the 2 of its expert-parallel subgroup (the Init asks each
    group's size and rank once, and must not mix them up); on one that does not, every param over the 4."""
    got = {}
    for backend in ("torch", "triton"):
        with fake_world(4, 1):
            subgroup = torch.distributed.new_group([0, 1])
            torch.manual_seed(5)
            with deepspeed.zero.Init(config_dict_or_path=config(backend, ztriton={"sharded_init_bytes": 512})):
                model = TwoGroups(subgroup)
            got[backend] = {n: (p.ds_tensor.numel(), valid_prefix(p, 1).clone()) for n, p in model.named_parameters()}
    per_param_groups = got["torch"]["expert"][0] == 5
    assert {n: numel for n, (numel, _) in got["triton"].items()} == \
        ({"shared": 3, "expert": 5, "big_shared": 75, "big_expert": 150} if per_param_groups else
         {"shared": 3, "expert": 3, "big_shared": 75, "big_expert": 75})
    for name, (numel, values) in got["torch"].items():
        assert got["triton"][name][0] == numel and torch.equal(got["triton"][name][1], values), name


def test_an_init_of_placeholders_only_never_probes_for_a_staging_chunk(fake_world, monkeypatch):
    """The staging chunk serves the partition path only: an Init whose params are all initialised shard by
    shard does not probe free memory to size it; one with ordinary params probes once (the threshold is
    configured, so nothing else probes)."""
    from ztriton import memory

    asked = []
    original = memory.probe_memory
    monkeypatch.setattr(memory, "probe_memory", lambda *a: asked.append(a) or original(*a))
    class Drawn(torch.nn.Module):
        def __init__(self, *numels):
            super().__init__()
            for i, numel in enumerate(numels):
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.nn.init.normal_(torch.empty(numel))))

    with fake_world(2, 0):
        with deepspeed.zero.Init(config_dict_or_path=config("triton", ztriton={"sharded_init_bytes": 64})):
            model = Drawn(100, 50)  # 400 and 200 bytes asked (fp32): placeholders
        assert asked == [] and model.p0.ds_tensor.numel() == 50
        with deepspeed.zero.Init(config_dict_or_path=config("triton", ztriton={"sharded_init_bytes": 64})):
            Drawn(100)
            Drawn(3, 5)  # 12 and 20 bytes: below the threshold, ordinary params
            Drawn(4)
        assert len(asked) == 1


# hpZ's secondary partition of a 1-element param fails in some DeepSpeed releases (a slice past its end).
HPZ_SHAPES = [shape for shape in SHAPES if math.prod(shape) > 1]


def test_unsupported_mode_falls_back_with_one_log_line(fake_world, caplog):
    """hpZ (secondary partitions) is DeepSpeed's alone: the key logs that and DeepSpeed partitions."""
    extra = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    sizes = {}
    for backend in ("torch", "triton"):
        with fake_world(4, 1), caplog.at_level(logging.INFO, logger="ztriton"):
            caplog.clear()
            with deepspeed.zero.Init(config_dict_or_path={**config(backend), **extra}):
                model = BitsModule(HPZ_SHAPES, seed=1)
            sizes[backend] = [(p.ds_tensor.numel(), valid_prefix(p, 1).clone()) for p in model.parameters()]
            lines = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
            assert lines == ([] if backend == "torch" else
                             ["ztriton: partition_backend='triton' falls back to DeepSpeed's zero.Init for hpZ "
                              "secondary partitions (zero_hpz_partition_size > 1), which ztriton does not handle"])
    for (n_off, v_off), (n_on, v_on) in zip(sizes["torch"], sizes["triton"]):
        assert n_off == n_on and torch.equal(v_off, v_on)


# ---------------------------------------------------------------------------------------------- training


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 24)
        self.hidden = torch.nn.Linear(24, 24)
        self.out = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def train(stage: int, dtype: torch.dtype, backend: str, steps: int = 3, under_init: bool = True,
          zero: dict | None = None):
    """Losses and final parameter bytes of a few steps of ``stage`` in the current world (``zero``: more
    ``zero_optimization`` settings)."""
    cfg = config(backend, stage=stage, dtype=dtype)
    cfg["zero_optimization"].update(zero or {})
    torch.manual_seed(1234)
    if stage == 3 and under_init:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = TinyNet()
    else:
        model = TinyNet().to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    data = torch.randn(steps, 2, 12, generator=torch.Generator().manual_seed(7)).to(dtype)
    losses = []
    for x in data:
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    rank = torch.distributed.get_rank()
    if stage == 3:
        final = [valid_prefix(p, rank).clone() for p in model.parameters()]
    else:
        final = [bits(p.data).clone() for p in model.parameters()]
    engine.destroy()
    return losses, final


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_training_key_on_matches_key_off(fake_world, caplog, stage, dtype):
    # A world of one: on the fake group of more ranks, gathers would leave other ranks' parts unset.
    with fake_world(1, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        off = train(stage, dtype, "torch")
        assert not caplog.records
        on = train(stage, dtype, "triton")
    ran = " | ".join(r.getMessage() for r in caplog.records)
    if stage == 3:  # zero.Init, then the optimizer's lp_param_buffer
        assert "zero.Init partitions through ztriton" in ran and "ztriton defragment of 6 partitions: device" in ran
    else:
        # (the "goes through ztriton" banner is once per process: tests/test_startup.py checks it)
        assert "ztriton: ZeRO-1/2 flatten, group 0: tier=device" in ran and "ztriton flatten group 0: device" in ran
    assert off[0] == on[0]
    for a, b in zip(off[1], on[1], strict=True):
        assert torch.equal(a, b)


def _zero2_engine(device: str = "cpu"):
    model = TinyNet().to(device=device, dtype=torch.bfloat16)
    return deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                config=config("triton", stage=2))[0]


def test_zero2_flatten_leaves_repointing_to_deepspeed_and_says_its_line_once_it_is_done(fake_world, caplog,
                                                                                        monkeypatch):
    """DeepSpeed re-points every param into the flat buffer right after the flatten
    (``_update_model_bit16_weights``), so the hook does not do it first; the group's line comes once the
    optimizer is built (its copies done by then), still naming the hook's function."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import ztriton.flatten

    asked, update = [], DeepSpeedZeroOptimizer._update_model_bit16_weights
    real_flatten = ztriton.flatten.flatten_groups
    monkeypatch.setattr(ztriton.flatten, "flatten_groups",
                        lambda *a, **k: asked.append(k.get("repoint", True)) or real_flatten(*a, **k))

    def update_then_mark(self, index):
        update(self, index)
        logging.getLogger("ztriton").info("test: DeepSpeed re-pointed group %d", index)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_update_model_bit16_weights", update_then_mark)
    with fake_world(1, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        engine = _zero2_engine()
        flat = engine.optimizer.bit16_groups_flat[0]
        for param in engine.module.parameters():
            assert param.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        engine.destroy()
    assert asked == [False]
    said = [r for r in caplog.records if r.name == "ztriton" and ("re-pointed group 0" in r.getMessage() or
                                                                  "ZeRO-1/2 flatten" in r.getMessage())]
    assert [r.getMessage().split(",")[0] for r in said] == ["test: DeepSpeed re-pointed group 0",
                                                           "ztriton: ZeRO-1/2 flatten"]
    assert said[1].funcName == "zero12_flatten" and said[1].filename.endswith("optimizers.py")


def test_zero2_flatten_lines_never_replace_deepspeeds_own_error(fake_world, monkeypatch, caplog):
    """The groups' lines are said in a ``finally`` once the optimizer is built or has failed: a log handler
    that raises there is reported at debug level, so DeepSpeed's own exception is the one the user sees (and a
    build that succeeded does not fail on a log line)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def broken_filter(record):
        if "ZeRO-1/2 flatten" in record.getMessage():
            raise ValueError("a broken log filter")
        return True

    def fails(self, index):
        raise RuntimeError("DeepSpeed failed after the flatten")

    logger = logging.getLogger("ztriton")
    logger.addFilter(broken_filter)
    try:
        with fake_world(1, 0), caplog.at_level(logging.INFO, logger="ztriton"):
            _zero2_engine().destroy()  # the line fails; the build does not
            monkeypatch.setattr(DeepSpeedZeroOptimizer, "_update_model_bit16_weights", fails)
            with pytest.raises(RuntimeError, match="DeepSpeed failed after the flatten"):
                _zero2_engine()
    finally:
        logger.removeFilter(broken_filter)


def test_stream_clock_takes_the_longer_of_host_and_stream_and_says_when_it_cannot_tell():
    class Events:
        def __init__(self, ms=None):
            self.ms = ms

        def synchronize(self):
            if self.ms is None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def elapsed_time(self, end):
            return end.ms

    clock = report.StreamClock(torch.device("cpu"))
    clock.stop()
    host = clock.seconds()
    assert host is not None and host >= 0
    clock._events = (Events(), Events(ms=5e3))  # the stream's 5 s, longer than the host's
    assert clock.seconds() == 5.0
    clock._events = (Events(), Events(ms=0.0))  # the stream reached the work when it was done: the host's
    assert clock.seconds() == host
    clock._events = (Events(), Events())  # a device error since
    assert clock.seconds() is None
    line = report.step_summary("a step", tier="device", nbytes=1 << 30, seconds=None, peak_bytes=None)
    assert "1.00 GiB in n/a, peak device n/a" in line and "GB/s" not in line


@pytest.mark.gpu
def test_zero2_flatten_on_the_device_waits_for_nothing(fake_world, caplog, monkeypatch):
    """The hook's flatten returns with the copies still running, as DeepSpeed's torch.cat does: the host goes
    on with DeepSpeed's next steps meanwhile. Its line's time comes from events on the stream."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    inside, waits = [], []
    hooked, synchronize = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned, torch.cuda.synchronize

    def flatten_spy(self, *args, **kwargs):
        inside.append(True)
        try:
            return hooked(self, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten_spy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: waits.append(bool(inside)) or synchronize(*a, **k))
    with fake_world(1, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        _zero2_engine("cuda").destroy()
    assert True not in waits
    (line,) = [r.getMessage() for r in caplog.records
               if r.name == "ztriton" and "ZeRO-1/2 flatten, group 0: tier=device" in r.getMessage()]
    assert " in 0.0 ms" not in line and "peak device n/a" not in line, line


def _own_flat_keeps_autograd_history() -> bool:
    """Whether DeepSpeed's own ZeRO-1/2 init-time flat buffer carries the params' autograd history (a
    ``torch.cat`` of them, not detached), which gloo's all-gather into its views refuses at the first step."""
    model = TinyNet().bfloat16()
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=config("torch", stage=2))[0]
    try:
        return engine.optimizer.bit16_groups_flat[0].grad_fn is not None
    finally:
        engine.destroy()


@contextlib.contextmanager
def _flat_buffers_detached():
    """DeepSpeed's ZeRO-1/2 flattens, their results detached (as later releases detach the init-time one): the
    bytes are DeepSpeed's own."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned
    DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = lambda self, *a, **k: flatten(self, *a, **k).detach()
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten


def _train_both(rank, world_size, stage, under_init):
    """Key off and key on; where DeepSpeed's own ZeRO-1/2 step fails on gloo (its flat buffer keeps autograd
    history), that failure is returned too, and key off runs with its flat buffers detached."""
    refused, detached = None, contextlib.nullcontext()
    zero = gloo_safe_gathers() if stage == 3 else {}
    if stage != 3 and _own_flat_keeps_autograd_history():
        try:
            train(stage, torch.bfloat16, "torch", under_init=under_init)
            refused = "DeepSpeed's own step ran"
        except RuntimeError as exc:
            refused = str(exc)
        detached = _flat_buffers_detached()
    with detached:
        off = train(stage, torch.bfloat16, "torch", under_init=under_init, zero=zero)
    return off, train(stage, torch.bfloat16, "triton", under_init=under_init, zero=zero), refused


@pytest.mark.slow
@pytest.mark.parametrize("stage, under_init", [(2, False), (3, True), (3, False)])
def test_training_key_on_matches_key_off_on_gloo(gloo_world, stage, under_init):
    """Real collectives: gradients reduce and partitions gather across two processes."""
    for off, on, refused in gloo_world(_train_both, 2, stage, under_init):
        assert refused is None or "is a view and is being modified inplace" in refused, refused
        assert off[0] == on[0]
        for a, b in zip(off[1], on[1], strict=True):
            assert torch.equal(a, b)


def _salted_partitions(rank, world_size):
    """Each rank builds different values; both backends must leave rank 0's everywhere."""
    out = {}
    for backend in ("torch", "triton"):
        cfg = config(backend, ztriton={"sharded_init_bytes": 64})
        cfg["zero_optimization"].update(gloo_safe_gathers())
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = BitsModule(SHAPES, seed=5, rank_salt=True)
        out[backend] = [valid_prefix(p, rank).clone() for p in model.parameters()]
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            out[backend + "_full"] = [bits(p.data).clone() for p in model.parameters()]
    return out


@pytest.mark.slow
def test_zero_init_values_are_rank0s_on_gloo(gloo_world):
    results = gloo_world(_salted_partitions, 2)
    expected = [bits(bits_tensor(shape, torch.bfloat16, 5, i)) for i, shape in enumerate(SHAPES)]
    for rank, result in enumerate(results):
        for a, b, full_on, want in zip(result["torch"], result["triton"], result["triton_full"], expected):
            assert torch.equal(a, b)
            assert torch.equal(full_on, want)


def _build_experts_under_init(backend: str, world_size: int, experts: int, width: int) -> tuple[int, Experts]:
    """Peak of newly allocated device memory while zero.Init builds Experts, and the model."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with deepspeed.zero.Init(config_dict_or_path=config(backend, ztriton={"sharded_init_bytes": 64 << 20})):
        model = Experts(experts, width)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, model


@pytest.mark.gpu
def test_large_param_never_lands_whole_on_the_device(fake_world):
    """A 256 MiB bf16 fused-expert tensor at W=8: with the key the device holds its 32 MiB shard (plus
    small params), never the whole tensor; DeepSpeed's own zero.Init holds it whole (in fp32 first)."""
    experts, width = 32, 1024  # experts: 32 x 1024 x 4096 bf16 = 256 MiB
    full = experts * width * 4 * width * 2
    with fake_world(8, 3):
        off_peak, off = _build_experts_under_init("torch", 8, experts, width)
        on_peak, on = _build_experts_under_init("triton", 8, experts, width)
        assert off_peak >= full, "DeepSpeed's path materialises the whole tensor on the device"
        assert on_peak < full // 8 + (8 << 20), f"peak {on_peak / 2**20:.1f} MiB for a 32 MiB shard"
        assert on.experts.ds_tensor.device.type == "cuda" and on.experts.ds_tensor.numel() == full // 2 // 8
        assert off.experts.ds_tensor.numel() == on.experts.ds_tensor.numel()


def test_key_read_from_json_path_and_deepspeed_config_object(tmp_path, fake_world, caplog, monkeypatch):
    from deepspeed.runtime.config import DeepSpeedConfig

    path = tmp_path / "ds_config.json"
    with fake_world(2, 1), caplog.at_level(logging.INFO, logger="ztriton"):
        path.write_text(json.dumps(config("triton", stage=3)))
        with deepspeed.zero.Init(config_dict_or_path=str(path)):
            torch.nn.Linear(4, 4)
        with deepspeed.zero.Init(config_dict_or_path=DeepSpeedConfig(config("triton", stage=3))):
            torch.nn.Linear(4, 4)
        model = torch.nn.Linear(4, 4)
        deepspeed.zero.Init(module=model, config_dict_or_path=DeepSpeedConfig(config("triton", stage=3)))
        assert model.weight.ds_tensor.numel() == 8
        assert [r.getMessage() for r in caplog.records].count(
            "ztriton: zero.Init partitions through ztriton (partitions on cpu; parameters of 1.00 GiB or more are "
            "initialised shard by shard)") == 3
    monkeypatch.setattr(report, "_said", set())  # the banner is said once per process, on rank 0
    with fake_world(2, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        path.write_text(json.dumps(config("triton", stage=2)))
        model = torch.nn.Linear(4, 4).bfloat16()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=str(path))
        engine.destroy()
    assert any("init-time flatten goes through ztriton" in r.getMessage() for r in caplog.records)


def test_long_loads_log_progress(fake_world, caplog, monkeypatch):
    monkeypatch.setattr(init_context, "PROGRESS_EVERY_BYTES", 1000)
    with fake_world(2, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        with deepspeed.zero.Init(config_dict_or_path=config("triton")):
            BitsModule([(300,), (400,), (10,)], seed=1)  # one module: 710 bf16 = 1420 bytes, past 1000
            BitsModule([(300,)], seed=2)  # 2020 bytes: past 2000
            BitsModule([(1,)], seed=3)  # 2022: no new mark
    progress = [r.getMessage() for r in caplog.records if "partitioned so far" in r.getMessage()]
    assert progress == ["ztriton zero.Init: 1.4 KiB of parameters partitioned so far (3 params)",
                        "ztriton zero.Init: 2.0 KiB of parameters partitioned so far (4 params)"]


class Linspace(torch.nn.Module):
    """A param made by an op zero.Init does not patch (linspace): fp32 inside a bf16 context."""

    def __init__(self):
        super().__init__()
        self.ramp = torch.nn.Parameter(torch.linspace(0.1, 7.3, 11))
        self.ints = torch.nn.Parameter(torch.arange(5, dtype=torch.int32), requires_grad=False)


def test_param_outside_the_context_dtype_is_cast_as_deepspeed_does(fake_world):
    got = {}
    for backend in ("torch", "triton"):
        with fake_world(2, 0):
            with deepspeed.zero.Init(config_dict_or_path=config(backend)):
                model = Linspace()
            got[backend] = [(p.ds_tensor.dtype, valid_prefix(p, 0).clone()) for p in model.parameters()]
    assert [d for d, _ in got["triton"]] == [torch.bfloat16, torch.int32]
    for (d_off, v_off), (d_on, v_on) in zip(got["torch"], got["triton"], strict=True):
        assert d_off == d_on and torch.equal(v_off, v_on)


def test_deprecated_config_argument_wins_as_in_deepspeed(fake_world, caplog):
    """zero.Init(config_dict_or_path=A, config=B) uses B in DeepSpeed; the key must be read from B too."""
    with fake_world(2, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        with deepspeed.zero.Init(config_dict_or_path=config("triton"), config=config("torch")):
            torch.nn.Linear(4, 4)
        assert not [r for r in caplog.records if "partitions through ztriton" in r.getMessage()]
        with deepspeed.zero.Init(config_dict_or_path=config("torch"), config=config("triton")):
            torch.nn.Linear(4, 4)
        assert [r for r in caplog.records if "partitions through ztriton" in r.getMessage()]


def test_free_memory_is_reported_truly_outside_the_optimizers_construction(fake_world):
    from deepspeed.accelerator import get_accelerator

    with fake_world(1, 0):
        model = torch.nn.Linear(4, 4).bfloat16()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config("triton", stage=2))
        engine.destroy()
        assert get_accelerator().available_memory() < 1 << 62


def test_partition_twice_is_a_clear_error_and_changes_nothing(fake_world):
    import ztriton

    with fake_world(2, 0):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        ztriton.partition(model)
        before = [(p.ds_tensor.data_ptr(), bits(p.ds_tensor).clone()) for p in model.parameters()]
        with pytest.raises(ValueError, match=r"already a ZeRO-3 parameter.*partition a module once"):
            ztriton.partition(model)
        assert [(p.ds_tensor.data_ptr(), bits(p.ds_tensor)) for p in model.parameters()][0][0] == before[0][0]
        assert all(torch.equal(bits(p.ds_tensor), b) for p, (_, b) in zip(model.parameters(), before))
        model.add_module("extra", torch.nn.Linear(2, 2))  # parameters added since: only those are partitioned
        result = ztriton.partition(model)
        assert [part.name for part in result.partitions] == ["extra.weight", "extra.bias"]


def test_a_config_with_the_key_imports_its_stage_s_module_then_starts_the_preload(monkeypatch):
    """Reading a config with the key imports the step's module at that ZeRO stage (the flatten's at 1 and 2, the
    defragment's at 3) on the caller's thread, then starts the preload, once per module and process; nothing for
    stage 0; a failing import or preload is no error there (the step reports it)."""
    import threading

    from ztriton.integrations.deepspeed import config

    from types import SimpleNamespace

    monkeypatch.setattr(config, "_prepared", set())
    done, threads = [], []

    def import_module(name):
        threads.append(threading.current_thread())
        done.append(name)
        if name == "ztriton.defragmenting":
            raise ImportError("a broken install")

    def start_preload(element_size):
        done.append(("preload", element_size))
        if len(done) > 2:
            raise RuntimeError("no CUDA context")

    monkeypatch.setattr(config, "importlib", SimpleNamespace(import_module=import_module))  # config's own name only
    monkeypatch.setattr(config, "start_preload", start_preload)
    config.prepare_step(0)
    config.prepare_step(None)
    assert done == []
    for stage, element_size in ((2, 2), (1, 2), (3, None), (3, 2)):
        config.prepare_step(stage, element_size)
    assert done == ["ztriton.flatten", ("preload", 2), "ztriton.defragmenting", ("preload", None)]  # each module once
    assert threads == [threading.current_thread()] * 2  # the caller's thread, no other
    config.prepare_step(2)
    assert len(done) == 4


def test_deepspeed_reading_a_config_with_the_key_starts_the_import(monkeypatch):
    """DeepSpeed's own config parse (the hook on DeepSpeedConfig) asks for the stage's module; without the key,
    nothing."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from ztriton.integrations.deepspeed import config

    asked = []
    monkeypatch.setattr(config, "prepare_step", lambda stage, element_size: asked.append((stage, element_size)))
    base = {"train_batch_size": 1, "zero_optimization": {"stage": 2}}
    DeepSpeedConfig(dict(base))
    DeepSpeedConfig({**base, "partition_backend": "triton"})
    DeepSpeedConfig({**base, "zero_optimization": {"stage": 3}, "partition_backend": "triton",
                     "bf16": {"enabled": True}})
    DeepSpeedConfig({**base, "partition_backend": "triton", "fp16": {"enabled": True}})
    # the params' bytes each where the config says (the engine casts the model under bf16 or fp16), else unknown
    assert asked == [(2, None), (3, 2), (2, 2)]
