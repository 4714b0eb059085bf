"""Tests for the 0.1.x keyword arguments of ``checkpoint`` (``matepoint_compat._deprecation``)."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import matepoint_compat
from matepoint_compat import MatepointDeprecationWarning, pop_legacy_checkpoint_kwargs


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("stream", "own side stream per device"),
        ("matepoint_ctx", "no longer needed"),
        ("check_inplace_modifications", "always checks"),
    ],
)
def test_each_legacy_kwarg_is_removed_with_one_warning(key: str, says: str) -> None:
    kwargs: dict[str, object] = {key: object(), "preserve_rng_state": False, "made_up": 1}
    with pytest.warns(MatepointDeprecationWarning, match=says) as record:
        pop_legacy_checkpoint_kwargs(kwargs, function=lambda x: x)
    assert [str(w.message).split(" is ")[0] for w in record] == [f"`{key}=`"]
    assert kwargs == {"preserve_rng_state": False, "made_up": 1}


def _declares(x: Any, stream: Any = None, *, matepoint_ctx: Any = None) -> Any:
    return x


def _takes_kwargs(x: Any, **kwargs: Any) -> Any:
    return x


@pytest.mark.parametrize("function", [_declares, _takes_kwargs])
def test_a_function_that_can_take_them_gets_them_without_warning(function: Any) -> None:
    kwargs: dict[str, object] = {"stream": 1, "matepoint_ctx": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pop_legacy_checkpoint_kwargs(kwargs, function=function)
    assert kwargs == {"stream": 1, "matepoint_ctx": 2}


def _checkpoint(**kwargs: object) -> None:
    """Stands in for core's checkpoint, which strips the legacy kwargs first."""
    pop_legacy_checkpoint_kwargs(kwargs)


def test_warning_points_at_the_users_checkpoint_call() -> None:
    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning) as record:
        _checkpoint(stream=None)
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_compat_never_imports_core() -> None:
    imported: set[str] = set()
    for path in Path(matepoint_compat.__file__).parent.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
    assert "torch" in imported
    assert not {m for m in imported if m == "matepoint" or m.startswith("matepoint.")}
