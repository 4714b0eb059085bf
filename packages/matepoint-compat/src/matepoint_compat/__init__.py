"""Per-torch-version shims for matepoint, its deprecation warning, and 0.1.x keyword handling.

Everything that differs between torch releases lives here, behind the named gates of
``matepoint_compat._version``. This package never imports ``matepoint`` (the core).

Note [Private tensor attributes read directly]
    Three private-named tensor attributes are read by the core without a shim: ``_version``
    (the in-place version counter), ``_is_view()`` and ``_base`` (a view and what it views).
    They sit on the per-tensor hot path, where a shim would add a Python call per saved tensor,
    and they have the same meaning on every supported release (2.4 to 2.15).
    ``test_torch_shims.py`` pins that meaning, so a release that changes it fails there first.
"""

# Each submodule's __all__ is the one list of its public names; the star imports re-export
# exactly those (type checkers treat a star import as an explicit re-export).
# ruff: noqa: F403
from matepoint_compat._accelerator import *
from matepoint_compat._checkpoint import *
from matepoint_compat._compile import *
from matepoint_compat._deprecation import *
from matepoint_compat._hooks import *
from matepoint_compat._planning import *
from matepoint_compat._pytree import *
from matepoint_compat._selective import *
from matepoint_compat._sharding import *
from matepoint_compat._version import *
from matepoint_compat._version_counter import *
from matepoint_compat._warnings import *
from matepoint_compat._wrapper import *

__version__ = "0.2.0"
