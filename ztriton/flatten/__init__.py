"""ZeRO-1/2 flatten: ``ztriton.flatten_groups`` (entry point and checks in :mod:`.groups`, tiers in :mod:`.tiers`)."""
from ztriton.flatten.groups import FlatGroup, flatten_groups

__all__ = ["FlatGroup", "flatten_groups"]
