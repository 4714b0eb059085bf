"""Shared fixtures for the matepoint-compat tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from matepoint_compat import _legacy


@pytest.fixture(autouse=True)
def _restore_legacy_state() -> Iterator[None]:
    """Put the process-wide legacy state (NOPIPELINE, pipeline callback, Gmatepoint_ctx) back.

    It is global on purpose, as it was in matepoint 0.1.x, so a test that sets it would otherwise
    leak into every test after it.
    """
    nopipeline = _legacy._STATE.nopipeline
    callback = _legacy._STATE.pipeline_callback
    ctx = list(_legacy._GMATEPOINT_CTX)
    yield
    _legacy._STATE.nopipeline = nopipeline
    _legacy._STATE.pipeline_callback = callback
    _legacy._GMATEPOINT_CTX[:] = ctx
