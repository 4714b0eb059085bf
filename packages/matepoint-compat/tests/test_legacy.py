"""Tests for matepoint_compat._legacy: the matepoint 0.1.x surface behind deprecation warnings."""

from __future__ import annotations

import ast
import sys
import types
import warnings
from pathlib import Path

import pytest

import matepoint_compat._legacy as legacy_module
from matepoint_compat._deprecation import MatepointDeprecationWarning
from matepoint_compat._legacy import (
    LEGACY_CHECKPOINT_KWARGS,
    LegacyModule,
    install_legacy_module,
    legacy_matepoint_pipeline,
    legacy_pipeline_disabled,
    pop_legacy_checkpoint_kwargs,
    register_pipeline_callback,
)


@pytest.fixture
def fake() -> LegacyModule:
    module = types.ModuleType("fake")
    install_legacy_module(module)
    assert isinstance(module, LegacyModule)
    return module


def _deprecations(record: pytest.WarningsRecorder) -> list[MatepointDeprecationWarning]:
    return [w.message for w in record if isinstance(w.message, MatepointDeprecationWarning)]


# --- install_legacy_module -------------------------------------------------------------------


def test_install_swaps_the_class_and_is_idempotent(fake: LegacyModule) -> None:
    assert type(fake) is LegacyModule
    install_legacy_module(fake)
    assert type(fake) is LegacyModule
    assert fake.__name__ == "fake"


def test_install_refuses_other_module_subclasses() -> None:
    class Custom(types.ModuleType):
        pass

    with pytest.raises(TypeError, match="plain module"):
        install_legacy_module(Custom("custom"))


def test_ordinary_attributes_are_untouched(fake: LegacyModule) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fake.answer = 42
        assert fake.answer == 42
        assert fake.__dict__["answer"] == 42
        del fake.answer
    assert "answer" not in fake.__dict__


# --- NOPIPELINE ------------------------------------------------------------------------------


def test_setting_nopipeline_warns_and_flips_the_state(fake: LegacyModule) -> None:
    assert legacy_pipeline_disabled() is False
    with pytest.warns(MatepointDeprecationWarning, match="pipeline=False") as record:
        fake.NOPIPELINE = True
    assert len(_deprecations(record)) == 1
    assert "`fake.NOPIPELINE`" in str(record[0].message)
    assert legacy_pipeline_disabled() is True

    with pytest.warns(MatepointDeprecationWarning, match="pipeline=False"):
        assert fake.NOPIPELINE is True

    with pytest.warns(MatepointDeprecationWarning, match="pipeline=False"):
        fake.NOPIPELINE = False
    assert legacy_pipeline_disabled() is False
    with pytest.warns(MatepointDeprecationWarning):
        assert fake.NOPIPELINE is False


def test_nopipeline_lives_in_process_state_not_the_module_dict(fake: LegacyModule) -> None:
    other = types.ModuleType("other")
    install_legacy_module(other)
    with pytest.warns(MatepointDeprecationWarning):
        fake.NOPIPELINE = 1
    assert "NOPIPELINE" not in fake.__dict__
    with pytest.warns(MatepointDeprecationWarning):
        assert other.NOPIPELINE is True


def test_nopipeline_warning_points_at_the_assignment(fake: LegacyModule) -> None:
    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning) as record:
        fake.NOPIPELINE = True
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_deleting_nopipeline_restores_the_default(fake: LegacyModule) -> None:
    with pytest.warns(MatepointDeprecationWarning):
        fake.NOPIPELINE = True
    with pytest.warns(MatepointDeprecationWarning, match="pipeline=False"):
        del fake.NOPIPELINE
    assert legacy_pipeline_disabled() is False


def test_monkeypatching_nopipeline_is_undone(
    fake: LegacyModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(MatepointDeprecationWarning):
        monkeypatch.setattr(fake, "NOPIPELINE", True)
    assert legacy_pipeline_disabled() is True
    with pytest.warns(MatepointDeprecationWarning):
        monkeypatch.undo()
    assert legacy_pipeline_disabled() is False


# --- other legacy names ----------------------------------------------------------------------


def test_gmatepoint_ctx_is_one_shared_list(fake: LegacyModule) -> None:
    with pytest.warns(MatepointDeprecationWarning, match="Gmatepoint_ctx"):
        first = fake.Gmatepoint_ctx
    with pytest.warns(MatepointDeprecationWarning, match="Gmatepoint_ctx"):
        second = fake.Gmatepoint_ctx
    assert first is second
    assert first == []


def test_gmatepoint_stream_is_none(fake: LegacyModule) -> None:
    with pytest.warns(MatepointDeprecationWarning, match="side stream"):
        assert fake.Gmatepoint_stream is None


def test_matepoint_pipeline_forwards_to_the_registered_callback(fake: LegacyModule) -> None:
    calls: list[str] = []
    with pytest.warns(MatepointDeprecationWarning, match="matepoint_pipeline"):
        pipeline = fake.matepoint_pipeline
    assert pipeline is legacy_matepoint_pipeline

    register_pipeline_callback(None)  # core registers one when it is imported in this process
    pipeline([], None)  # no callback registered: a no-op
    assert register_pipeline_callback(lambda: calls.append("prefetch")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline([["cpu args"], ["devices"], "tag"], object())
        pipeline()
    assert calls == ["prefetch", "prefetch"]


def test_register_pipeline_callback_returns_the_previous_one() -> None:
    def first() -> None:
        pass

    register_pipeline_callback(first)
    assert register_pipeline_callback(None) is first
    legacy_matepoint_pipeline()


def test_assigning_a_legacy_name_warns_that_it_has_no_effect(fake: LegacyModule) -> None:
    replacement: list[object] = []
    with pytest.warns(MatepointDeprecationWarning, match="no effect"):
        fake.Gmatepoint_ctx = replacement
    assert fake.Gmatepoint_ctx is replacement


def test_unknown_names_raise_attribute_error_without_warning(fake: LegacyModule) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="module 'fake' has no attribute 'nope'") as info:
            _ = fake.nope
        assert info.value.name == "nope"
        assert info.value.obj is fake
        assert not hasattr(fake, "NoPipeline")


def test_from_import_of_a_package_warns_once(
    fake: LegacyModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A package (it has __path__) makes importlib probe the name with hasattr before reading it.
    fake.__path__ = []
    monkeypatch.setitem(sys.modules, "fake", fake)
    namespace: dict[str, object] = {}
    with pytest.warns(MatepointDeprecationWarning) as record:
        exec("from fake import Gmatepoint_ctx, NOPIPELINE", namespace)
    assert len(_deprecations(record)) == 2
    assert namespace["NOPIPELINE"] is False
    assert namespace["Gmatepoint_ctx"] == []


# --- checkpoint kwargs -----------------------------------------------------------------------


def test_legacy_kwarg_names() -> None:
    assert {"stream", "matepoint_ctx", "check_inplace_modifications"} == LEGACY_CHECKPOINT_KWARGS


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("stream", "own side stream per device"),
        ("matepoint_ctx", "no longer needed"),
        ("check_inplace_modifications", "always checks"),
    ],
)
def test_pop_removes_each_legacy_kwarg_with_one_warning(key: str, says: str) -> None:
    kwargs: dict[str, object] = {key: object(), "preserve_rng_state": False}
    with pytest.warns(MatepointDeprecationWarning, match=says) as record:
        pop_legacy_checkpoint_kwargs(kwargs)
    assert len(_deprecations(record)) == 1
    assert f"`{key}=`" in str(record[0].message)
    assert kwargs == {"preserve_rng_state": False}


def test_pop_removes_all_at_once() -> None:
    kwargs: dict[str, object] = {
        "stream": None,
        "matepoint_ctx": [],
        "check_inplace_modifications": True,
        "use_reentrant": False,
    }
    with pytest.warns(MatepointDeprecationWarning) as record:
        pop_legacy_checkpoint_kwargs(kwargs)
    assert len(_deprecations(record)) == 3
    assert kwargs == {"use_reentrant": False}


def test_pop_leaves_unknown_kwargs_alone() -> None:
    kwargs: dict[str, object] = {"pipeline": False, "context_fn": print, "made_up": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pop_legacy_checkpoint_kwargs(kwargs)
    assert kwargs == {"pipeline": False, "context_fn": print, "made_up": 1}


def _checkpoint(**kwargs: object) -> None:
    """Stands in for core's checkpoint, which strips the legacy kwargs first."""
    pop_legacy_checkpoint_kwargs(kwargs)


def test_pop_warning_points_at_the_users_checkpoint_call() -> None:
    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning) as record:
        _checkpoint(stream=None)
    assert (record[0].filename, record[0].lineno) == (__file__, line)


# --- layering --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["_legacy.py", "_deprecation.py"])
def test_never_imports_core(name: str) -> None:
    source = Path(legacy_module.__file__).with_name(name).read_text(encoding="utf-8")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            imported.add(node.module)
    assert not {m for m in imported if m == "matepoint" or m.startswith("matepoint.")}
