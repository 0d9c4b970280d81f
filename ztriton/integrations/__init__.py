"""The only code that imports DeepSpeed or transformers (``docs/architecture.md``, "Rooms").

* :mod:`ztriton.integrations.deepspeed`: the ``"partition_backend"`` config key and its ``"ztriton"``
  section, the hooks into DeepSpeed, ZeRO-3 parameters, ``zero.Init`` and the ZeRO optimizers.
* ``ztriton.integrations.transformers``: ``from_pretrained`` under ZeRO-3 (shard-on-read loading).
"""
