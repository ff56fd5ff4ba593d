"""Regional compilation (``qaic_dynamo.compile``): each repeated block traced once.

:mod:`.plan` finds the regions, :mod:`.compile` compiles them in place, :mod:`.dispatch`
calls a compiled block past Dynamo's entry once its guards pass, and :mod:`.settings`
holds Dynamo's settings for a qaic compile.
"""

from qaic_dynamo.compiler.regions.compile import CompiledRegion, compile, mark_dynamic_dims
from qaic_dynamo.compiler.regions.dispatch import DYNAMO_SKIPPED, GuardedDispatch
from qaic_dynamo.compiler.regions.plan import RegionPlan, find_repeated_blocks, plan_regions
from qaic_dynamo.compiler.regions.precompile import wait_for_saves
from qaic_dynamo.compiler.regions.settings import REGION_RECOMPILE_LIMIT, region_config, specialized_floats

__all__ = [
    "DYNAMO_SKIPPED",
    "REGION_RECOMPILE_LIMIT",
    "CompiledRegion",
    "GuardedDispatch",
    "RegionPlan",
    "compile",
    "find_repeated_blocks",
    "mark_dynamic_dims",
    "plan_regions",
    "region_config",
    "specialized_floats",
    "wait_for_saves",
]
