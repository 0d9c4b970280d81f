"""Exact sharded init: record the init calls made on a parameter during construction, then let each
rank generate only its own slice of it, bit-identical to running the calls on the full tensor.

Knows nothing of DeepSpeed: the ``zero.Init`` integration (``ztriton.integrations.deepspeed``) makes
the placeholders, and at each module's end swaps them for partitions filled by :func:`replay`::

    with Recorder() as recorder:                       # around the model's construction
        weight = recorder.placeholder((n, m), torch.bfloat16, "cuda")  # in place of torch.empty
        torch.nn.init.normal_(weight, std=0.02)        # recorded; the CUDA generator advances as if run
        ...
        for name, param, record in recorder.take_parameters(module):   # at the module's end
            if record is not None:
                agree([record], group)                 # rank 0's generator states (one broadcast)
                replay(record, partition, start, count)  # this rank's elements, padding zeroed
                recorder.release(record)

Modules: :mod:`.philox` (CUDA counter arithmetic), :mod:`.rng` (generator states), :mod:`.record` (what
a placeholder remembers), :mod:`.recorder` (placeholders and their records), :mod:`.modes` (the torch modes it
watches through), :mod:`.aten_ops` (which ops can be recorded), :mod:`.callers` (the places its log lines name),
:mod:`.replay`, :mod:`.selfcheck` (whether this torch and device generate as :mod:`.philox` says: checked once per kind
before it is first recorded; a kind that fails is generated in full).
"""
from ztriton.sharded_init.record import Record
from ztriton.sharded_init.recorder import Recorder, active_recorder, placeholder, prepare
from ztriton.sharded_init.replay import agree, materialise, replay

__all__ = ["Record", "Recorder", "active_recorder", "agree", "materialise", "placeholder", "prepare", "replay"]
