"""Per-torch-version shims for matepoint, its deprecation warning, and 0.1.x keyword handling.

Everything that differs between torch releases lives here, behind the named gates of
``matepoint_compat._version``. This package never imports ``matepoint`` (the core).
"""

from matepoint_compat._accelerator import (
    allocate_pinned,
    delay_stream,
    device_module,
    new_event,
    new_stream,
    set_current_stream,
    storage_use_count,
    stream_context,
)
from matepoint_compat._checkpoint import (
    adapt_checkpoint_kwargs,
    unwind_failed_checkpoint,
)
from matepoint_compat._compile import (
    COMPILED_OFFLOAD,
    COMPILED_OFFLOAD_STREAMS,
    annotate_offload,
    compile_tracing,
    compiled_offload_config,
    forward_nodes,
    install_joint_pass,
    mark_for_offload,
    nbytes_hint,
    offloaded_nodes,
    producers_outside_regions,
    recompute_all_context_fn,
    region_inputs,
    run_at_trace_time,
)
from matepoint_compat._deprecation import MatepointDeprecationWarning, warn_deprecated
from matepoint_compat._hooks import saved_tensors_hooks_active, saved_tensors_hooks_enabled
from matepoint_compat._legacy import pop_legacy_checkpoint_kwargs
from matepoint_compat._planning import (
    CUDA_FUSED_RMS_NORM,
    TorchDispatchMode,
    meta_checkpointing,
    op_flops,
    run_backward,
)
from matepoint_compat._pytree import tree_flatten, tree_unflatten
from matepoint_compat._version import (
    TORCH_2_5_PLUS,
    TORCH_2_6_PLUS,
    TORCH_2_8_PLUS,
    TORCH_2_9_PLUS,
    TORCH_2_11_PLUS,
    TORCH_2_12_PLUS,
    TORCH_2_13_PLUS,
    TORCH_2_14_PLUS,
    TORCH_VERSION,
    parse_base_version,
)
from matepoint_compat._version_counter import version_witness
from matepoint_compat._warnings import TORCH_WARNING_FILTERS, ignore_torch_warnings
from matepoint_compat._wrapper import torch_apply_activation_checkpointing, torch_checkpoint_wrapper

__version__ = "0.2.0"

__all__ = [
    "COMPILED_OFFLOAD",
    "COMPILED_OFFLOAD_STREAMS",
    "CUDA_FUSED_RMS_NORM",
    "TORCH_2_5_PLUS",
    "TORCH_2_6_PLUS",
    "TORCH_2_8_PLUS",
    "TORCH_2_9_PLUS",
    "TORCH_2_11_PLUS",
    "TORCH_2_12_PLUS",
    "TORCH_2_13_PLUS",
    "TORCH_2_14_PLUS",
    "TORCH_VERSION",
    "TORCH_WARNING_FILTERS",
    "MatepointDeprecationWarning",
    "TorchDispatchMode",
    "__version__",
    "adapt_checkpoint_kwargs",
    "allocate_pinned",
    "annotate_offload",
    "compile_tracing",
    "compiled_offload_config",
    "delay_stream",
    "device_module",
    "forward_nodes",
    "ignore_torch_warnings",
    "install_joint_pass",
    "mark_for_offload",
    "meta_checkpointing",
    "nbytes_hint",
    "new_event",
    "new_stream",
    "offloaded_nodes",
    "op_flops",
    "parse_base_version",
    "pop_legacy_checkpoint_kwargs",
    "producers_outside_regions",
    "recompute_all_context_fn",
    "region_inputs",
    "run_at_trace_time",
    "run_backward",
    "saved_tensors_hooks_active",
    "saved_tensors_hooks_enabled",
    "set_current_stream",
    "storage_use_count",
    "stream_context",
    "torch_apply_activation_checkpointing",
    "torch_checkpoint_wrapper",
    "tree_flatten",
    "tree_unflatten",
    "unwind_failed_checkpoint",
    "version_witness",
    "warn_deprecated",
]
