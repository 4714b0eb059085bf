"""The offload engine: where each checkpoint's saved inputs live, and how they travel.

- ``transport``: the narrow interface to the device (host blocks, copies, events), CUDA's.
- ``pool``: the exact-size pinned host blocks, reused across steps.
- ``channel_engine``: one device channel's policy (stash, look-ahead, dedupe, release).
- ``saving``: the saved-tensor hooks and the keep rule (which inputs stay on the device).
- ``active_transport``, ``engines``, ``planning_scope``: which transport is in use, the engine
  per channel, and the plan a thread runs (Note [Planning scope]).
- ``stats``: the counters and the report.

The engine never imports the planner; the planner runs this engine over a channel that moves
nothing.
"""
