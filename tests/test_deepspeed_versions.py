"""The DeepSpeed integration on every supported DeepSpeed: the variants of its internals told apart by what the
installed DeepSpeed has (``ztriton/integrations/deepspeed/variants.py``), and all hooks or none.

* An internal that matches no known variant: ``install()`` returns False, every DeepSpeed function is its own
  again but the key reader, and the stand-aside line is said once, on rank 0, only for a config with the key.
* Each variant's behaviour on the stack that has it: the tests branch on what this DeepSpeed does (observed with
  the key off) and check that the variant chosen is that one, and that the key on gives the same bytes.
"""
from __future__ import annotations

import inspect
import logging
import types

import pytest
import torch

import deepspeed
from ds_reference import BitsModule, bits, dtype_config
from ztriton.integrations import standaside
from ztriton.integrations.deepspeed import install, report, variants
from ztriton.integrations.deepspeed.state import STATE
from ztriton.layout import zero3_slice

STOOD_ASIDE = "has no effect on DeepSpeed in this process"


def config(backend: str | None, stage: int = 3, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, **dtype_config(torch.bfloat16), **extra}
    if backend is not None:
        cfg["partition_backend"] = backend
    return cfg


def _stage3_class():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3


# ------------------------------------------------------------------------------------ all hooks or none


def _flatten_with_an_extra_parameter(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def flatten(self, tensor_list, alignment, use_cpu_data=False, param_padding=None, extra=None):
        raise AssertionError("never called")

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten)
    return "flatten_dense_tensors_aligned"


def _post_init_with_an_extra_parameter(monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    monkeypatch.setattr(Init, "_post_init_method", lambda self, module, extra: None)
    return "_post_init_method"


def _no_convert_to_deepspeed_param(monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    monkeypatch.delattr(Init, "_convert_to_deepspeed_param")
    return "_convert_to_deepspeed_param is missing"


def _optimizer_without_its_flat_groups(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "__init__", lambda self, *args, **kwargs: None)
    return "bit16_groups_flat"


def _defragment_in_neither_place(monkeypatch):
    from deepspeed.runtime.zero import stage3

    if hasattr(stage3, "defragment"):
        monkeypatch.delattr(stage3, "defragment")
    else:
        monkeypatch.delattr(_stage3_class(), "defragment")
    return "neither a function of stage3 nor a staticmethod"


def _defragment_in_both_places(monkeypatch):
    """Benign for DeepSpeed itself: it keeps calling the one it called."""
    from deepspeed.runtime.zero import stage3

    if hasattr(stage3, "defragment"):
        monkeypatch.setattr(_stage3_class(), "defragment", staticmethod(stage3.defragment), raising=False)
    else:
        monkeypatch.setattr(stage3, "defragment", _stage3_class().defragment, raising=False)
    return "both a function of stage3 and a staticmethod"


def _keep_in_fp32_without_its_call(monkeypatch):
    """``Init._keep_in_fp32`` present where ``_post_init_method`` does not call it, or absent where it does."""
    from deepspeed.runtime.zero.partition_parameters import Init

    if hasattr(Init, "_keep_in_fp32"):
        monkeypatch.delattr(Init, "_keep_in_fp32")
    else:
        monkeypatch.setattr(Init, "_keep_in_fp32", lambda self, module: None, raising=False)
    return "_keep_in_fp32 are not a known pair"


def _partition_world_size_without_per_param_groups(monkeypatch):
    """``Init._partition_world_size`` present where params take the Init's group, or absent where they take
    their own."""
    from deepspeed.runtime.zero.partition_parameters import Init

    if hasattr(Init, "_partition_world_size"):
        monkeypatch.delattr(Init, "_partition_world_size")
    else:
        monkeypatch.setattr(Init, "_partition_world_size", lambda self, param: 1, raising=False)
    return "_partition_world_size"


def _engine_configuring_its_optimizer_otherwise(monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(DeepSpeedEngine, "_configure_zero_optimizer", lambda self, optimizer, mpu: None)
    return "_configure_zero_optimizer"


def _a_wrap_that_fails_midway(monkeypatch):
    """Every internal known, the sixth wrap fails: the five before it must come out again."""
    calls = []
    wrap = install._wrap

    def failing(owner, name, wrapper, into=None):
        calls.append(name)
        if len(calls) == 6:
            raise RuntimeError("the sixth wrap fails")
        return wrap(owner, name, wrapper, into)

    monkeypatch.setattr(install, "_wrap", failing)
    return "the sixth wrap fails"


UNKNOWN = [_flatten_with_an_extra_parameter, _post_init_with_an_extra_parameter, _no_convert_to_deepspeed_param,
           _optimizer_without_its_flat_groups, _defragment_in_neither_place, _defragment_in_both_places,
           _keep_in_fp32_without_its_call, _partition_world_size_without_per_param_groups,
           _engine_configuring_its_optimizer_otherwise, _a_wrap_that_fails_midway]


@pytest.fixture
def stood_aside(monkeypatch):
    """The hooks taken out, an internal made unknown by the test, install() tried again; afterwards everything
    put back and the hooks in again."""
    hooked = list(STATE.originals)
    assert len(hooked) == 11, "the hooks are installed before the test"
    install.uninstall()
    report._said.clear()
    try:
        yield hooked
    finally:
        monkeypatch.undo()
        install.uninstall()
        standaside.REASONS.pop("DeepSpeed", None)
        report._said.clear()
        assert install.install()


def _own(owner, name):
    """What ``owner`` itself holds under ``name`` (None when inherited)."""
    return vars(owner).get(name)


@pytest.mark.parametrize("make_unknown", UNKNOWN, ids=[f.__name__.strip("_") for f in UNKNOWN])
def test_an_unknown_internal_installs_no_hook_but_the_key_reader(stood_aside, make_unknown, monkeypatch, caplog,
                                                                fake_world):
    from deepspeed.runtime.config import DeepSpeedConfig

    said = make_unknown(monkeypatch)
    deepspeeds = {key: _own(*key) for key in stood_aside}  # after the change: DeepSpeed as the test left it
    assert install.install() is False
    assert not install.installed() and not STATE.originals
    assert said in standaside.REASONS["DeepSpeed"], standaside.REASONS["DeepSpeed"]
    reader = (DeepSpeedConfig, "__init__")
    assert list(STATE.key_reader) == [reader]
    for key, function in deepspeeds.items():
        if key != reader:
            assert _own(*key) is function, key
    assert DeepSpeedConfig.__init__.__wrapped__ is deepspeeds[reader]

    def lines():  # ztriton's logger's records (DeepSpeed's logger may pass the same line on to the root too)
        return [r.getMessage() for r in caplog.records if r.name == "ztriton" and STOOD_ASIDE in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="ztriton"):
        with fake_world(2, 1):
            DeepSpeedConfig(config("triton"))  # rank 1: nothing
        assert lines() == []
        with fake_world(2, 0):
            off = config(None)
            assert DeepSpeedConfig(off)._param_dict is off  # the key reader passes the config on untouched
            DeepSpeedConfig(config("torch"))
            assert lines() == []
            DeepSpeedConfig(config("triton"))
            DeepSpeedConfig(config("triton"))
    assert len(lines()) == 1 and "DeepSpeed" in lines()[0] and said in lines()[0], lines()


def test_stood_aside_zero_init_is_deepspeeds_own(stood_aside, monkeypatch, caplog, fake_world):
    """Where ztriton stood aside, zero.Init under the key partitions with DeepSpeed's code: no ztriton line but the
    stand-aside one, the same bytes as without the key."""
    _defragment_in_both_places(monkeypatch)
    assert install.install() is False
    got = {}
    with caplog.at_level(logging.INFO, logger="ztriton"):
        for backend in ("torch", "triton"):
            with fake_world(2, 1):
                with deepspeed.zero.Init(config_dict_or_path=config(backend)):
                    model = BitsModule([(5, 3), (7,)], seed=2)
                got[backend] = [bits(p.ds_tensor)[:zero3_slice(p.ds_numel, 2).valid_numel(1)].clone()
                                for p in model.parameters()]
    assert [r for r in caplog.records if "partitions through ztriton" in r.getMessage()] == []
    for off, on in zip(got["torch"], got["triton"], strict=True):
        assert torch.equal(off, on)


def test_key_off_passes_a_config_object_on_as_deepspeed_would(fake_world):
    """DeepSpeed cannot read a DeepSpeedConfig given as a config; with the key off it fails the same way with
    the hooks in as without them (only a config asking for ztriton is read as its dict)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    def error(hooks: bool):
        with fake_world(1, 0):
            inner = DeepSpeedConfig(config("torch"))
            if not hooks:
                install.uninstall()
            try:
                DeepSpeedConfig(inner)
            except Exception as exc:  # noqa: BLE001 -- the error itself is what is compared
                return type(exc), str(exc)
            finally:
                if not hooks:
                    assert install.install()
        return None

    own = error(hooks=False)
    assert own is not None and error(hooks=True) == own
    with fake_world(1, 0):
        assert DeepSpeedConfig(DeepSpeedConfig(config("triton")))._param_dict["partition_backend"] == "triton"


# ------------------------------------------------------------------------------------ the variants


class Routed(torch.nn.Module):
    """A transformers-style module naming a buffer for fp32 (``_keep_in_fp32_modules_strict``)."""

    _keep_in_fp32_modules_strict = ["correction_bias"]

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.full((6, 4), 0.25))
        self.register_buffer("correction_bias", torch.full((8,), 5.005))  # made in the Init's dtype


def test_keep_in_fp32_as_this_deepspeed_does(fake_world):
    """A DeepSpeed whose zero.Init keeps a module's named buffers in fp32 after partitioning: the key does too;
    one that does not: the key leaves them in the Init's dtype. The variant chosen is the one observed."""
    got = {}
    for backend in ("torch", "triton"):
        with fake_world(2, 0):
            with deepspeed.zero.Init(config_dict_or_path=config(backend)):
                model = Routed()
        got[backend] = model.correction_bias
    kept = got["torch"].dtype == torch.float32
    assert kept or got["torch"].dtype == torch.bfloat16
    assert STATE.variants.keep_in_fp32 is (variants.keep_in_fp32 if kept else variants.keep_nothing_in_fp32)
    assert got["triton"].dtype == got["torch"].dtype and torch.equal(bits(got["triton"]), bits(got["torch"]))


def test_partition_group_as_this_deepspeed_gives_it(fake_world):
    """The group DeepSpeed gives a param carrying ``ds_zero_partition_process_group``: its own, or the Init's. The
    variant chosen is the one observed (test_integration checks key on against key off for both)."""
    with fake_world(4, 1):
        subgroup = torch.distributed.new_group([0, 1])
        model = torch.nn.Module()
        model.expert = torch.nn.Parameter(torch.zeros(10))
        model.expert.ds_zero_partition_process_group = subgroup
        deepspeed.zero.Init(module=model, config_dict_or_path=config("torch"))
        own_group = model.expert.ds_process_group is subgroup
        assert model.expert.ds_tensor.numel() == (5 if own_group else 3)
    assert STATE.variants.partition_group is (variants.param_group if own_group else variants.init_group)


def _zero12_flat(backend: str, alignment: bool | None):
    """Group 0 of a ZeRO-2 engine on odd-sized bf16 params: its flat bytes and where each param lies in it."""
    zero = {"stage": 2, "round_robin_gradients": True}
    if alignment is not None:
        zero["parameter_alignment"] = alignment
    model = BitsModule([(5,), (3, 3), (1,), (7,), (2,)], seed=4, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={**config(backend, stage=2), "zero_optimization": zero})[0]
    try:
        flat = engine.optimizer.bit16_groups_flat[0]
        offsets = [p.data.storage_offset() - flat.storage_offset() for p in model.parameters()]
        return bits(flat).clone(), offsets, flat.grad_fn is None
    finally:
        engine.destroy()


def test_zero12_flatten_as_this_deepspeed_lays_it_out(fake_world, caplog):
    """The init-time flatten under the key gives this DeepSpeed's bytes and offsets: with per-param 16-byte pads
    where its optimizer has ``parameter_alignment`` (both settings), params end to end where it has none. The
    variant chosen is the one its flatten's signature says, and the hook did the flatten."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    flatten = inspect.unwrap(DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned)
    padded = "param_padding" in inspect.signature(flatten).parameters
    assert (STATE.variants.flatten_call.__qualname__.split(".")[0] ==
            ("padded_flatten_call" if padded else "unpadded_flatten_call"))
    for alignment in ((False, True) if padded else (None,)):
        with caplog.at_level(logging.INFO, logger="ztriton"):
            caplog.clear()
            with fake_world(3, 0):  # rank 0: the one that says the hook's line
                off = _zero12_flat("torch", alignment)
                on = _zero12_flat("triton", alignment)
        assert [r for r in caplog.records if "ZeRO-1/2 flatten, group 0" in r.getMessage()], alignment
        assert torch.equal(off[0], on[0]) and off[1] == on[1], alignment
        assert on[2], "ztriton's flat buffer carries no autograd history"
        assert all(offset % 8 == 0 for offset in on[1]) == bool(alignment), on[1]  # bf16: 16 bytes = 8


def test_unpadded_flatten_call_takes_only_the_init_time_flatten():
    """Without ``param_padding``, the init-time call is the one flattening ``round_robin_bit16_groups[index]``
    from the device; a step's or checkpoint's flatten of other tensors, and the host copy, are DeepSpeed's."""
    def flatten(self, tensor_list, alignment, use_cpu_data=False):
        pass

    call = variants.unpadded_flatten_call(inspect.signature(flatten))
    group = [torch.zeros(3), torch.zeros(5)]
    optimizer = types.SimpleNamespace(bit16_groups_flat=[torch.zeros(8)], round_robin_bit16_groups=[[], group])
    taken = call(optimizer, (group, 4), {"use_cpu_data": False})
    assert taken == variants.FlattenCall(1, group, 4, False, None, None)
    assert call(optimizer, (group, 4), {"use_cpu_data": True}) is None
    assert call(optimizer, (list(group), 4), {}) is None  # equal tensors, another list: a later flatten
    optimizer.bit16_groups_flat.append(torch.zeros(8))  # every group built: nothing is init-time any more
    assert call(optimizer, (group, 4), {}) is None


def test_padded_flatten_call_takes_only_the_call_with_param_padding():
    def flatten(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
        pass

    call = variants.padded_flatten_call(inspect.signature(flatten))
    group = [torch.zeros(3), torch.zeros(5)]
    optimizer = types.SimpleNamespace(bit16_groups_flat=[], parameter_alignment=1, round_robin_bit16_offsets=[[0, 8]],
                                      round_robin_bit16_padding=[[5, 0]])
    assert call(optimizer, (group, 4), {"param_padding": [5, 0]}) == \
        variants.FlattenCall(0, group, 4, True, [0, 8], [5, 0])
    assert call(optimizer, (group, 4, False, [5, 0]), {}) == variants.FlattenCall(0, group, 4, True, [0, 8], [5, 0])
    assert call(optimizer, (group, 4), {}) is None
    assert call(optimizer, (group, 4), {"use_cpu_data": True, "param_padding": [5, 0]}) is None


def test_stage3_defragment_hook_sits_where_the_optimizer_calls_it(fake_world, caplog):
    """The stage-3 optimizer calls its defragment as a function of stage3 or as a staticmethod of its class: the
    hook is there (the lp_param_buffer goes through ztriton), and outside the optimizer's construction the
    function is DeepSpeed's, called as DeepSpeed calls it."""
    from deepspeed.runtime.zero import stage3

    static = STATE.variants.defragment_static
    assert static == isinstance(vars(_stage3_class()).get("defragment"), staticmethod) != hasattr(stage3, "defragment")
    owner = _stage3_class() if static else stage3
    assert owner.defragment.__wrapped__.__name__ == "defragment"
    tensors = [torch.arange(3.0), torch.arange(4.0)]
    flat = owner.defragment(tensors)  # no optimizer being built: DeepSpeed's own
    assert torch.equal(flat, torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0]))
    if static:
        assert torch.equal(_stage3_class().__new__(_stage3_class()).defragment([torch.ones(2)]), torch.ones(2))
    with fake_world(1, 0), caplog.at_level(logging.INFO, logger="ztriton"):
        model = torch.nn.Linear(4, 3).bfloat16()
        engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config("triton", stage=3))[0]
        engine.destroy()
    assert [r for r in caplog.records if "ZeRO-3 lp_param_buffer (defragment)" in r.getMessage()
            and "tensors=2" in r.getMessage()]


def test_a_new_world_forgets_the_last_worlds_process_groups(fake_world):
    """DeepSpeed caches process groups (the world's clone) in deepspeed.utils.groups; whether or not its
    destroy_process_group releases them, a world's teardown leaves none for the next world's engine."""
    from deepspeed.utils import groups

    for world_size in (2, 3):
        with fake_world(world_size, 1):
            model = torch.nn.Linear(4, 3).bfloat16()
            engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config("torch", stage=2))[0]
            assert groups._WORLD_GROUP is not None
            assert torch.distributed.get_world_size(groups._get_data_parallel_group()) == world_size
            engine.destroy()
        assert groups._WORLD_GROUP is None
