"""The 0.1.x import path ``matepoint.matepoint`` works, with a warning at the importing line."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import matepoint
from matepoint_compat import MatepointDeprecationWarning, legacy_pipeline_disabled
from matepoint_compat._deprecation import LEGACY_CONTEXT_LIST

# Line 3 imports the module the first time: the warning must name that line of this script.
_SCRIPT = textwrap.dedent(
    """\
    import warnings
    warnings.simplefilter("always")
    from matepoint.matepoint import checkpoint, checkpoint_sequential
    import matepoint
    assert checkpoint is matepoint.checkpoint
    assert checkpoint_sequential is matepoint.checkpoint_sequential
    print("imported")
    """
)


def test_importing_the_legacy_path_warns_at_the_importing_line(tmp_path: Path) -> None:
    # A fresh interpreter, so that the import really runs the module (pytest's has it cached).
    script = tmp_path / "train_legacy.py"
    script.write_text(_SCRIPT, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"
    warning_lines = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert warning_lines == [
        f"{script}:3: MatepointDeprecationWarning: `matepoint.matepoint` is deprecated; import "
        "from `matepoint` instead (`from matepoint import checkpoint`) (deprecated in "
        "matepoint 0.2.0, to be removed in 0.4.0)"
    ]


def _legacy_path() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MatepointDeprecationWarning)
        return importlib.import_module("matepoint.matepoint")


def test_legacy_globals_are_the_packages_and_warn() -> None:
    module = _legacy_path()
    with pytest.warns(MatepointDeprecationWarning, match=r"`matepoint\.matepoint\.Gmatepoint_ctx`"):
        ctx = module.Gmatepoint_ctx
    assert ctx is LEGACY_CONTEXT_LIST
    with pytest.warns(MatepointDeprecationWarning, match="prefetch_now"):
        stand_in = matepoint.matepoint_pipeline  # type: ignore[attr-defined]
    with pytest.warns(MatepointDeprecationWarning, match="prefetch_now"):
        assert module.matepoint_pipeline is stand_in
    with pytest.warns(MatepointDeprecationWarning):
        assert module.Gmatepoint_stream is None
    with pytest.raises(AttributeError, match="no attribute 'checkpoint_function'"):
        module.checkpoint_function


def test_setting_nopipeline_on_the_legacy_path_turns_pipelining_off() -> None:
    # 0.1.x read this module's NOPIPELINE; 0.2 reads the package's, so the setting moves there.
    module = _legacy_path()
    assert not legacy_pipeline_disabled()
    with pytest.warns(MatepointDeprecationWarning, match=r"`matepoint\.matepoint\.NOPIPELINE`"):
        module.NOPIPELINE = True
    assert legacy_pipeline_disabled()
    assert vars(matepoint)["NOPIPELINE"] is True
    with pytest.warns(MatepointDeprecationWarning):
        assert module.NOPIPELINE is True
    del module.NOPIPELINE
    assert not legacy_pipeline_disabled()
