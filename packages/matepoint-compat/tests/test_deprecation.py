"""Tests for matepoint_compat._deprecation."""

from __future__ import annotations

import sys
import warnings

import pytest

import matepoint_compat
from matepoint_compat._deprecation import (
    DEFAULT_REMOVAL,
    DEFAULT_SINCE,
    MatepointDeprecationWarning,
    warn_deprecated,
)


def _deprecated_api() -> None:
    warn_deprecated("`old_api`", replacement="use `new_api` instead")


def test_warning_is_shown_to_users_by_default_with_versions() -> None:
    w = MatepointDeprecationWarning("`a` is deprecated", since="0.2.0", removal="0.4.0")
    # FutureWarning: Python's default filters show it even when raised from an imported module.
    assert isinstance(w, FutureWarning)
    assert not isinstance(w, DeprecationWarning)
    assert (w.message, w.since, w.removal) == ("`a` is deprecated", "0.2.0", "0.4.0")
    assert str(w) == "`a` is deprecated (deprecated in matepoint 0.2.0, to be removed in 0.4.0)"


def test_warning_defaults() -> None:
    w = MatepointDeprecationWarning("m")
    assert (w.since, w.removal) == (DEFAULT_SINCE, DEFAULT_REMOVAL) == ("0.2.0", "0.4.0")


def test_warn_deprecated_names_the_replacement() -> None:
    with pytest.warns(MatepointDeprecationWarning, match="use `new_api` instead") as record:
        _deprecated_api()
    assert len(record) == 1
    warning = record[0].message
    assert isinstance(warning, MatepointDeprecationWarning)
    assert warning.message == "`old_api` is deprecated; use `new_api` instead"
    assert (warning.since, warning.removal) == ("0.2.0", "0.4.0")


def test_warn_deprecated_carries_custom_versions() -> None:
    with pytest.warns(MatepointDeprecationWarning, match="0.1.8.*0.3.0") as record:
        warn_deprecated("`x`", replacement="use `y`", since="0.1.8", removal="0.3.0")
    warning = record[0].message
    assert isinstance(warning, MatepointDeprecationWarning)
    assert (warning.since, warning.removal) == ("0.1.8", "0.3.0")


def test_warning_points_at_the_callers_line() -> None:
    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning) as record:
        _deprecated_api()
    assert record[0].filename == __file__
    assert record[0].lineno == line


def test_stacklevel_one_points_at_the_deprecated_function() -> None:
    def deprecated_here() -> int:
        warn_deprecated("`x`", replacement="use `y`", stacklevel=1)
        return deprecated_here.__code__.co_firstlineno + 1

    with pytest.warns(MatepointDeprecationWarning) as record:
        line = deprecated_here()
    assert record[0].lineno == line


def test_can_be_turned_into_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", MatepointDeprecationWarning)
        with pytest.raises(MatepointDeprecationWarning, match="old_api"):
            _deprecated_api()


@pytest.mark.skipif(
    not matepoint_compat.COMPILED_OFFLOAD,
    reason="matepoint has no compiled path on this torch (Dynamo graph-breaks at its checkpoint)",
)
def test_under_torch_compile_the_warning_is_given_at_trace_time_at_the_callers_line() -> None:
    """Dynamo cannot trace the warning's construction (a fullgraph compile failed); see Note
    [Deprecation warnings under torch.compile]."""
    import inspect

    import torch

    def compiled(x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            _deprecated_api()  # the line the warning names, once per line by default
        return x + 1

    line = inspect.getsourcelines(compiled)[1] + 2
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        out = torch.compile(compiled, backend="eager", fullgraph=True)(torch.zeros(2))
        torch.compile(compiled, backend="eager", fullgraph=True)(torch.zeros(2))  # no retrace
    torch._dynamo.reset()
    assert out.tolist() == [1.0, 1.0]
    ours = [w for w in caught if issubclass(w.category, MatepointDeprecationWarning)]
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)]
    assert "`old_api` is deprecated" in str(ours[0].message)
