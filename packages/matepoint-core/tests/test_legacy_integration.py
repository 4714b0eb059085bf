"""The matepoint 0.1.x surface, end to end through the core: it warns, and it still trains right.

``matepoint_compat`` tests the legacy names in isolation; here they go through
``matepoint.checkpoint`` and the engine: ``matepoint.NOPIPELINE = True`` must really switch
pipelining off (no prefetches, no side-stream copies), the old keyword arguments must be dropped
with a warning attributed to the caller's line while gradients stay equal to torch's, and the old
importable names must warn on import.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
from matepoint.testing import CPUTestTransport
from matepoint_compat import MatepointDeprecationWarning

SEED = 99
WIDTH = 16


def chain(checkpoint: Callable[..., Any], count: int = 6) -> list[torch.Tensor]:
    """One seeded step through ``count`` checkpointed blocks; returns output and gradients."""
    torch.manual_seed(SEED)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2), nn.Tanh()) for _ in range(count)
    )
    x = torch.randn(4, WIDTH, requires_grad=True)
    h = x
    for block in blocks:
        h = checkpoint(block, h)
    h.square().sum().backward()
    assert x.grad is not None
    return [h.detach(), x.grad, *(parameter.grad for parameter in blocks.parameters())]


def this_line() -> int:
    """The caller's current line number."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def torch_reference(use_reentrant: bool) -> list[torch.Tensor]:
    return chain(functools.partial(torch_checkpoint.checkpoint, use_reentrant=use_reentrant))


def assert_all_equal(mine: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    assert len(mine) == len(reference)
    for index, (a, b) in enumerate(zip(mine, reference, strict=True)):
        assert torch.equal(a, b), f"tensor {index} differs from torch's"


# -- NOPIPELINE --------------------------------------------------------------------------------


def test_nopipeline_warns_and_disables_pipelining(
    cpu_transport: CPUTestTransport, use_reentrant: bool
) -> None:
    mate = functools.partial(matepoint.checkpoint, use_reentrant=use_reentrant)
    reference = torch_reference(use_reentrant)

    # Pipelined (the default): copies queue on the side stream and backward prefetches.
    assert_all_equal(chain(mate), reference)
    pipelined = matepoint.stats()
    assert pipelined.offloads > 0
    assert pipelined.prefetches > 0

    line = this_line() + 2
    with pytest.warns(MatepointDeprecationWarning, match=r"NOPIPELINE.*pipeline=False") as caught:
        matepoint.NOPIPELINE = True
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    with pytest.warns(MatepointDeprecationWarning, match="NOPIPELINE"):
        assert matepoint.NOPIPELINE is True

    matepoint.reset_stats()
    side_stream = cpu_transport.channel(torch.empty(0)).side  # type: ignore[attr-defined]
    queued_before = len(side_stream.pending)
    copies_before = cpu_transport.copies_out
    assert_all_equal(chain(mate), reference)  # pipeline=True on the call, overridden globally
    synchronous = matepoint.stats()
    assert synchronous.offloads == pipelined.offloads
    assert cpu_transport.copies_out - copies_before == synchronous.offloads
    assert synchronous.prefetches == 0
    assert synchronous.prefetch_hits == 0
    assert synchronous.fetches > 0
    # Synchronous copies never touch the side stream.
    assert len(side_stream.pending) == queued_before

    # Setting it back re-enables pipelining (and warns again).
    with pytest.warns(MatepointDeprecationWarning, match="NOPIPELINE"):
        matepoint.NOPIPELINE = False
    matepoint.reset_stats()
    assert_all_equal(chain(mate), reference)
    assert matepoint.stats().prefetches > 0


# -- 0.1.x keyword arguments -------------------------------------------------------------------

LEGACY_KWARGS: dict[str, Any] = {
    "stream": None,
    "matepoint_ctx": [],
    "check_inplace_modifications": True,
}


@pytest.mark.parametrize("name", sorted(LEGACY_KWARGS))
def test_legacy_kwarg_warns_and_gives_torch_gradients(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, name: str
) -> None:
    calls: list[int] = []

    def legacy_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
        calls.append(1)
        options = {"use_reentrant": use_reentrant, "pipeline": pipeline, name: LEGACY_KWARGS[name]}
        line = this_line() + 2
        with pytest.warns(MatepointDeprecationWarning, match=f"`{name}=`") as caught:
            result = matepoint.checkpoint(function, *args, **options)
        assert len(caught) == 1
        # Attributed to the line that passed the keyword, the line the user must change.
        assert (caught[0].filename, caught[0].lineno) == (__file__, line)
        return result

    mine = chain(legacy_checkpoint)
    stats = matepoint.stats()
    assert calls
    assert stats.offloads > 0
    assert cpu_transport.copies_out > 0
    assert_all_equal(mine, torch_reference(use_reentrant))


def test_all_legacy_kwargs_at_once(cpu_transport: CPUTestTransport, use_reentrant: bool) -> None:
    def legacy_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
        with pytest.warns(MatepointDeprecationWarning) as caught:
            result = matepoint.checkpoint(
                function, *args, use_reentrant=use_reentrant, **LEGACY_KWARGS
            )
        assert sorted(str(w.message).split("=")[0].strip("`") for w in caught) == sorted(
            LEGACY_KWARGS
        )
        return result

    mine = chain(legacy_checkpoint)
    assert matepoint.stats().offloads > 0
    assert_all_equal(mine, torch_reference(use_reentrant))


def test_legacy_kwarg_in_checkpoint_sequential(
    cpu_transport: CPUTestTransport, use_reentrant: bool
) -> None:
    sequential_line = 0

    def step(sequential: Callable[..., Any], **extra: Any) -> list[torch.Tensor]:
        torch.manual_seed(SEED)
        model = nn.Sequential(
            *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4))
        )
        x = torch.randn(4, WIDTH, requires_grad=True)
        nonlocal sequential_line
        sequential_line = this_line() + 1
        out = sequential(model, 4, x, use_reentrant=use_reentrant, **extra)
        out.sum().backward()
        assert x.grad is not None
        return [out.detach(), x.grad, *(parameter.grad for parameter in model.parameters())]

    with pytest.warns(MatepointDeprecationWarning, match="`stream=`") as caught:
        mine = step(matepoint.checkpoint_sequential, stream=None)
    # Backward runs in the block: torch 2.4 adds its own autocast FutureWarning there. pytest.warns
    # re-emits what did not match, and pytest.ini's filters (torch's own ignored) judge those.
    ours = [w for w in caught if issubclass(w.category, MatepointDeprecationWarning)]
    assert len(ours) == 1
    assert (ours[0].filename, ours[0].lineno) == (__file__, sequential_line)
    assert matepoint.stats().offloads == 3
    assert_all_equal(mine, step(torch_checkpoint.checkpoint_sequential))


# -- 0.1.x importable names --------------------------------------------------------------------


def test_import_gmatepoint_ctx_warns() -> None:
    line = this_line() + 2
    with pytest.warns(MatepointDeprecationWarning, match="Gmatepoint_ctx") as caught:
        from matepoint import Gmatepoint_ctx
    assert len(caught) == 1
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert isinstance(Gmatepoint_ctx, list)


def test_legacy_names_do_not_change_training(cpu_transport: CPUTestTransport) -> None:
    """0.1.x code that imports the old names and calls the old pipeline hook still trains right."""
    with pytest.warns(MatepointDeprecationWarning, match="Gmatepoint_ctx"):
        from matepoint import Gmatepoint_ctx
    with pytest.warns(MatepointDeprecationWarning, match="matepoint_pipeline"):
        from matepoint import matepoint_pipeline

    def legacy_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
        out = matepoint.checkpoint(function, *args, use_reentrant=False)
        matepoint_pipeline(Gmatepoint_ctx, None)
        return out

    mine = chain(legacy_checkpoint)
    assert matepoint.stats().offloads > 0
    assert_all_equal(mine, torch_reference(False))
