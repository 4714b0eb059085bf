"""matepoint: a drop-in ``torch.utils.checkpoint`` that offloads checkpoint inputs to host memory.

Replace ``from torch.utils.checkpoint import checkpoint`` with ``from matepoint import checkpoint``:
gradients stay identical, and the activations a checkpointed model still keeps (each checkpoint's
inputs) move to pinned CPU RAM during forward and come back just in time in backward, on a side
stream that overlaps compute.
"""

import sys

import matepoint_compat as _compat
from matepoint._checkpoint import checkpoint, checkpoint_sequential
from matepoint._engine.stats import OffloadStats
from matepoint._errors import (
    BudgetOutOfMemoryError,
    InplaceModificationError,
    MatepointError,
    PinnedMemoryExhausted,
)
from matepoint._guard import BudgetGuard, BudgetOvershootWarning, GuardReading, budget_guard
from matepoint._monitor import prefetch_now, release_pool, report, reset_stats, stats
from matepoint._options import OffloadOptions, OffloadSettings, configure, get_options, options
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.live_model import plan_budget
from matepoint._planner.memory_plan import (
    MemoryPlan,
    Recommendation,
    StrategyPlan,
    TimelinePoint,
    plan,
)
from matepoint._planner.time_model import DeviceModel, calibrate

__version__ = "0.2.0"

if _compat.__version__ != __version__:
    raise ImportError(
        f"matepoint {__version__} needs matepoint-compat {__version__}, but "
        f"{_compat.__version__} is installed; install matching versions "
        f"(pip install 'matepoint-compat=={__version__}')"
    )

__all__ = [
    "BudgetGuard",
    "BudgetOutOfMemoryError",
    "BudgetOvershootWarning",
    "BudgetPlan",
    "DeviceModel",
    "GuardReading",
    "InplaceModificationError",
    "MatepointError",
    "MemoryPlan",
    "OffloadOptions",
    "OffloadSettings",
    "OffloadStats",
    "PinnedMemoryExhausted",
    "Recommendation",
    "StrategyPlan",
    "TimelinePoint",
    "__version__",
    "budget_guard",
    "calibrate",
    "checkpoint",
    "checkpoint_sequential",
    "configure",
    "get_options",
    "options",
    "plan",
    "plan_budget",
    "prefetch_now",
    "release_pool",
    "report",
    "reset_stats",
    "stats",
]

# The deprecated 0.1.x globals (NOPIPELINE and the rest): see matepoint_compat._deprecation.
_compat.install_legacy_globals(sys.modules[__name__], prefetch_now)
