"""The planner: a training step's memory, traffic and time, on the meta device, before a GPU.

- ``trace`` and ``kernels``: the memory tracker and the CUDA kernels' allocations, on meta.
- ``step``: one planned step under a strategy, running the engine over a channel that moves
  nothing (Note [Planning scope] in ``matepoint._engine.planning_scope``).
- ``op_kinds``: what each checkpointed region computes, by kind of op.
- ``time_model``: the device's rates, the step-time estimate and calibration.
- ``optimizer_states``: the device bytes an optimizer's states take.
- ``policy``: a budget plan's selective-checkpoint policy, per region; ``scoped_modes``:
  torch's selective-checkpoint modes entered only around the module calls that run what a
  policy keeps or offloads.
- ``live_model`` and ``sharded_twin``: the one call on the user's model (its meta twin, an
  FSDP2 model's per rank).
- ``decision``, ``search`` (with ``search_state`` and ``conclusion``) and ``budget_plan``: the
  budget search's rule over plain numbers, the loop that plans the steps it compares, and its
  answer.
- ``recommend`` and ``memory_plan``: the options search and ``matepoint.plan``.

The planner imports the engine and the settings, never the front door's checkpoint.
"""
