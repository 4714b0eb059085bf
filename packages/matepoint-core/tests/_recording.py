"""What the reliability tests record for ``tools/reliability_report.py`` (``docs/reliability.md``).

Each reliability test calls :func:`report` with pytest's ``record_property`` fixture; the values
land in the junit XML (``junit_family = xunit1`` keeps them) that the report script renders.
"""

from __future__ import annotations

from collections.abc import Callable

Record = Callable[[str, object], None]
"""pytest's ``record_property`` fixture."""


def rss_bytes() -> int:
    """The process's resident memory in bytes (0 where ``/proc`` does not exist)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except OSError:  # not Linux
        return 0


def report(
    record_property: Record,
    *,
    area: str,
    case: str,
    checks: str,
    guarantees: str,
    steps: int | None = None,
    faults: int | None = None,
    before: dict[str, int] | None = None,
    after: dict[str, int] | None = None,
    **numbers: object,
) -> None:
    """Record a test's description and numbers for ``tools/reliability_report.py``.

    ``area`` is the report's section (faults, inputs, autograd, long runs); ``guarantees`` the
    comma-separated guarantees the test backs (the report's guarantees section names them);
    ``before`` / ``after`` are memory levels, recorded as ``<name>_before`` / ``<name>_after``.
    """
    record_property("area", area)
    record_property("case", case)
    record_property("checks", checks)
    record_property("guarantees", guarantees)
    if steps is not None:
        record_property("steps", steps)
    if faults is not None:
        record_property("faults_injected", faults)
    for stage, values in (("before", before), ("after", after)):
        for name, value in (values or {}).items():
            record_property(f"{name}_{stage}", value)
    for name, number in numbers.items():
        record_property(name, number)
