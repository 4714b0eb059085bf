"""Tests for the compiled path's passes (``matepoint._compiled``) and where they read torch's
internals from (``matepoint_compat._compile._torch_names``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import matepoint_compat as compat
from matepoint._compiled import scope

_STREAM_SETTINGS = (
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)


@pytest.fixture
def functorch_settings() -> Iterator[None]:
    """Leave the AOTAutograd settings the test changes as they were; skip where torch lacks them."""
    import torch._functorch.config as config

    if not all(hasattr(config, name) for name in _STREAM_SETTINGS):
        pytest.skip("this torch has no compiled activation offloading")
    saved = {name: getattr(config, name) for name in _STREAM_SETTINGS}
    yield
    for name, value in saved.items():
        setattr(config, name, value)


@pytest.mark.skipif(not compat.COMPILED_OFFLOAD, reason="this torch has no compiled offload path")
@pytest.mark.usefixtures("functorch_settings")
def test_choosing_the_transfer_stream_makes_record_stream_compile() -> None:
    import torch._functorch.config as config

    scope.compiled_offload_config(pipelined=True)
    assert config.activation_offload_separate_stream is True
    assert config.activation_reload_prefetch is True
    assert config.activation_offload_sink_wait is False
    record_stream = torch.ops.streams.record_stream.default
    # What inductor does with the op: run its fake implementation on a fake tensor.
    with FakeTensorMode():
        assert record_stream(torch.empty(4), 0) is None
    # And a graph pass must not drop it as unused: it returns nothing but has an effect.
    graph = torch.fx.Graph()
    value = graph.placeholder("value")
    graph.call_function(record_stream, (value, 0))
    graph.output(value)
    graph.eliminate_dead_code()
    assert [node.target for node in graph.nodes if node.op == "call_function"] == [record_stream]


@pytest.mark.usefixtures("functorch_settings")
def test_synchronous_copies_leave_the_stream_settings_off() -> None:
    import torch._functorch.config as config

    scope.compiled_offload_config(pipelined=False)
    assert not any(getattr(config, name) for name in _STREAM_SETTINGS)


@pytest.mark.skipif(not compat.COMPILED_OFFLOAD, reason="this torch has no compiled offload path")
def test_a_compile_scope_restores_every_setting_it_set() -> None:
    """Note [Compile settings are scoped]: the settings hold from the trace until the compile
    ends, and the joint pass's choices for its graph are undone with them."""
    import torch._functorch.config as config

    passes: list[torch.fx.GraphModule] = []

    def own(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        passes.append(graph)
        return graph

    before = {name: getattr(config, name) for name in compat.COMPILE_SETTINGS}
    scope.open_compile_scope(own)
    try:
        scope.open_compile_scope(own)  # once per compile
        assert config.enable_activation_offloading is True
        graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        assert config.joint_custom_pass(graph, None) is graph
        assert passes == [graph]
        scope.compiled_offload_config(pipelined=False)
    finally:
        scope.close_compile_scope()
    assert {name: getattr(config, name) for name in compat.COMPILE_SETTINGS} == before
    scope.close_compile_scope()  # nothing open: nothing to do


def _private_torch_names(path: Path) -> list[str]:
    """``torch._x`` attributes, and string constants naming a private attribute, in code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                found.append(ast.unparse(node))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.append(node.module or "")
    return found


def test_every_private_torch_name_of_the_compiled_path_is_in_torch_names() -> None:
    import matepoint._compiled as passes
    import matepoint_compat._compile as package

    folder = Path(package.__file__).parent
    modules = [path for path in folder.glob("*.py") if path.name != "_torch_names.py"]
    modules.append(folder.parent / "_deprecation.py")
    modules += Path(passes.__file__).parent.glob("*.py")
    assert len(modules) >= 7
    named = {f"{path.parent.name}/{path.name}": path for path in modules}
    assert {name: _private_torch_names(path) for name, path in named.items()} == {
        name: [] for name in named
    }
    assert _private_torch_names(folder / "_torch_names.py")  # where they are
