"""The numbers the reliability tests record as data, and the process's resident memory.

Each reliability test calls :func:`report` with pytest's ``record_property`` fixture; the values
(steps run, faults injected, memory levels before and after) land in the junit XML
(``junit_family = xunit1`` keeps them), where a maintainer refreshing docs/reliability.md reads
them. The tests assert the behaviour; the numbers are data, not prose.
"""

from __future__ import annotations

from collections.abc import Callable

from matepoint._engine.stats import rss_bytes as _rss_bytes

Record = Callable[[str, object], None]
"""pytest's ``record_property`` fixture."""


def rss_bytes() -> int:
    """The process's resident memory in bytes (0 where it cannot be read: not Linux)."""
    return _rss_bytes() or 0


def report(
    record_property: Record,
    *,
    steps: int | None = None,
    faults: int | None = None,
    before: dict[str, int] | None = None,
    after: dict[str, int] | None = None,
    **numbers: object,
) -> None:
    """Record a test's numbers; ``before``/``after`` levels as ``<name>_before``/``_after``."""
    if steps is not None:
        record_property("steps", steps)
    if faults is not None:
        record_property("faults_injected", faults)
    for stage, values in (("before", before), ("after", after)):
        for name, value in (values or {}).items():
            record_property(f"{name}_{stage}", value)
    for name, number in numbers.items():
        record_property(name, number)
