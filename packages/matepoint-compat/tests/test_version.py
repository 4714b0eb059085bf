"""The version gates: parsing torch version strings and the gates computed from them."""

from __future__ import annotations

import pytest
import torch

import matepoint_compat as compat


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.13.0", (2, 13, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.4.1+cu121", (2, 4, 1)),
        ("2.15.0.dev20260101", (2, 15, 0)),
        ("2.15.0.dev20260101+cu128", (2, 15, 0)),
        ("2.14.0rc1", (2, 14, 0)),
        ("2.14.0a0+git1234abc", (2, 14, 0)),
        ("2.9", (2, 9, 0)),
        ("2.10.2", (2, 10, 2)),
        (" 2.6.0 ", (2, 6, 0)),
        ("10.0.0", (10, 0, 0)),
    ],
)
def test_parse_base_version(version: str, expected: tuple[int, int, int]) -> None:
    assert compat.parse_base_version(version) == expected


@pytest.mark.parametrize("version", ["", "torch", "2", "v2.13.0", "two.one"])
def test_parse_base_version_rejects_garbage(version: str) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        compat.parse_base_version(version)


def test_minor_versions_compare_numerically_not_as_strings() -> None:
    # "2.10" < "2.9" as strings; the gates must never compare strings.
    assert compat.parse_base_version("2.10.0") > compat.parse_base_version("2.9.0")
    assert compat.parse_base_version("2.13.0+cpu") >= (2, 13, 0)


def test_release_candidates_and_nightlies_count_as_their_release() -> None:
    assert compat.parse_base_version("2.14.0rc2") >= (2, 14, 0)
    assert compat.parse_base_version("2.14.0.dev20260301") >= (2, 14, 0)


def test_installed_version_matches_torch() -> None:
    assert compat.parse_base_version(torch.__version__) == compat.TORCH_VERSION
    assert compat.TORCH_VERSION[:2] == tuple(int(part) for part in torch.__version__.split(".")[:2])


def test_gates_agree_with_torch_features() -> None:
    import inspect

    import torch.utils.checkpoint as torch_checkpoint

    assert hasattr(torch, "accelerator") == compat.TORCH_2_6_PLUS
    parameters = inspect.signature(torch_checkpoint.checkpoint).parameters
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if not has_kwargs:
        assert ("early_stop" in parameters) == compat.TORCH_2_9_PLUS
        assert ("respect_saved_tensors_hooks" in parameters) == compat.TORCH_2_14_PLUS
