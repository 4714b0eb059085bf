"""Run the reliability tests and write docs/reliability.md from what they recorded.

``python tools/reliability_report.py [--out FILE] [--no-slow] [--junit FILE] [--gpu-junit FILE]
[-- PYTEST ARGS]``

Runs (with the current interpreter) ``test_reliability.py`` and ``test_faults_and_inputs.py`` of
matepoint-core, the long soak included, plus the tests of the other suites that cover cases of the
reliability checklist (``ELSEWHERE``), with ``--junitxml`` into a temporary folder. The first two
record, per test, ``record_property`` values: ``area``, ``case``, ``checks``, ``guarantees``
(comma-separated keys of ``GUARANTEES``), ``steps``, ``faults_injected``, ``<level>_before`` /
``<level>_after`` pairs (live records, pool bytes, device bytes, RSS) and other numbers. This
script turns them into the page: one table per area, the guarantees and which tests back them in
this run, and the machine it ran on. ``nox -s reliability-report`` runs it.

``--junit FILE`` renders an existing junit XML (pytest's ``xunit1`` family, which keeps the
properties) instead of running the tests. ``--gpu-junit FILE`` (default
``docs/_data/gpu-reliability.xml``, written by a GPU run of the ``gpu`` tests) fills the page's
"On a GPU" section: the rows ``test_cuda_reliability.py`` and ``test_cuda_soak.py`` recorded,
with their numbers, and the outcome of every other GPU test; ``docs/_data/gpu-results.json``
names the machine.

Exit status: pytest's (the page is written whenever the tests ran, failures included, so a
failing run is visible on the page too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "packages/matepoint-core/tests"
RECORDING_FILES = (f"{TESTS}/test_reliability.py", f"{TESTS}/test_faults_and_inputs.py")
GPU_RESULTS = ROOT / "docs" / "_data" / "gpu-results.json"
GPU_JUNIT = ROOT / "docs" / "_data" / "gpu-reliability.xml"
DEFAULT_OUT = ROOT / "docs" / "reliability.md"

AREAS = (
    ("faults", "Faults"),
    ("inputs", "Bad and unusual input"),
    ("autograd", "Concurrency and autograd variety"),
    ("long runs", "Long runs"),
)

GUARANTEES = {
    "recovery": "After every injected fault (an exception in forward or in recomputation, a graph "
    "dropped without backward, KeyboardInterrupt in forward, between forward and backward or "
    "during backward, an out-of-memory error while copying a saved input back, pinned memory "
    "exhausted) the next training step runs and its gradients are bitwise equal to "
    "`torch.utils.checkpoint`'s.",
    "no-leak": "Once the failed step's graph and exception are gone, no offload record is alive, "
    "no pinned block is in use, no device original is held, and the pinned pool is back at its "
    "size before the fault (blocks are reused, not re-allocated). matepoint needs no cleanup call.",
    "clear-errors": "Misuse and faults raise at once with an error that names the cause: the "
    "unknown argument, the tensor modified in place (type, shape, versions), the cap or "
    "allocation that failed and the policy to switch to. Where torch's checkpoint raises, "
    "matepoint raises the same exception type (or a subclass of it).",
    "parity": "Inputs of every kind listed (complex, conjugate, sparse, strided, zero-size, "
    "integer, bf16, without grad, mixed host and device) and every autograd entry point tested "
    "give outputs and gradients bitwise equal to torch's checkpoint, or the error torch gives.",
    "exhaustion-policy": "When the pinned pool cap or page-locked host memory runs out, "
    "`on_pool_exhausted='pageable'` (the default) warns once and continues with pageable copies, "
    "gradients unchanged, the pageable buffers freed with their step; "
    "`on_pool_exhausted='raise'` raises `matepoint.PinnedMemoryExhausted` (a `MemoryError`) "
    "from the checkpoint call that hit the limit, leaving nothing behind.",
    "concurrency": "Threads training their own models through one engine get exact gradients "
    "(backward, `autograd.grad`, `create_graph`).",
    "bounded": "Over long runs with changing shapes and dropped graphs no record outlives its "
    "step, the pool stops growing after warm-up, and process RSS stays bounded.",
}

# Tests of the parity, engine and pool suites that cover items of the reliability checklist.
# They record no numbers; their rows say what they check and how they came out in this run.
ELSEWHERE: tuple[tuple[str, str, str, str, str], ...] = (
    # (node id, area, case, what is checked, guarantees)
    (
        f"{TESTS}/test_checkpoint.py::test_exception_in_function_propagates_and_next_step_works",
        "faults",
        "exception in forward / in recompute (all modes)",
        "the exception reaches the caller unchanged, as with torch; no record alive; next step "
        "equals torch; every pipeline, reentrant and completion mode",
        "recovery,no-leak,parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_graph_dropped_without_backward_frees_records",
        "faults",
        "graph dropped without backward (all modes)",
        "records die with the graph; next step equals torch",
        "recovery,no-leak",
    ),
    (
        f"{TESTS}/test_engine.py::test_graph_dropped_with_copies_in_flight_keeps_sources_alive",
        "faults",
        "graph dropped with copies in flight",
        "queued copies still find their source; nothing left afterwards",
        "no-leak",
    ),
    (
        f"{TESTS}/test_pool.py::test_cap_with_raise_policy_raises_then_next_step_works",
        "faults",
        "pool cap reached, policy 'raise'",
        "PinnedMemoryExhausted (a MemoryError); nothing leaked; next steps equal torch",
        "exhaustion-policy,recovery,no-leak",
    ),
    (
        f"{TESTS}/test_pool.py::test_cap_with_pageable_policy_warns_once_and_stays_correct",
        "faults",
        "pool cap reached, policy 'pageable'",
        "one ResourceWarning over four steps; gradients equal torch; pageable bytes freed",
        "exhaustion-policy,no-leak",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_inference_mode_tensor_input",
        "inputs",
        "input: inference-mode tensor",
        "non-reentrant: RuntimeError as torch's; reentrant: runs as torch's",
        "clear-errors,parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_inplace_modification_after_forward_raises",
        "inputs",
        "in-place write after forward (offloaded, kept, parameter)",
        "backward raises 'modified by an inplace operation' like torch, all modes",
        "clear-errors,parity",
    ),
    (
        f"{TESTS}/test_engine.py::test_empty_tensor_stays_in_place",
        "inputs",
        "input: zero-size tensor",
        "a 0-element input stays in place; backward works",
        "parity",
    ),
    (
        f"{TESTS}/test_engine.py::test_transposed_input_comes_back_with_its_strides",
        "inputs",
        "input: transposed view fetched from the host",
        "comes back with the original strides; gradients equal torch",
        "parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_autograd_grad",
        "autograd",
        "torch.autograd.grad",
        "equal to torch (reentrant: the same error as torch)",
        "parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_double_backward",
        "autograd",
        "create_graph (double backward)",
        "second-order gradients equal to torch",
        "parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_backward_with_inputs",
        "autograd",
        "backward(inputs=...)",
        "only the chosen inputs get gradients, equal to torch",
        "parity",
    ),
    (
        f"{TESTS}/test_checkpoint.py::test_retain_graph_two_backwards",
        "autograd",
        "retain_graph, two backwards",
        "both backwards equal to torch; host copies outlive the first unpack",
        "parity",
    ),
    (
        f"{TESTS}/test_engine.py::test_no_growth_over_1000_steps",
        "long runs",
        "1000 steps, no growth",
        "pool, records, dedupe index and queued copies stay constant",
        "bounded,no-leak",
    ),
)

LEVELS = (
    ("live_records", "live records"),
    ("pool_in_use_bytes", "pool in use"),
    ("pool_pinned_bytes", "pool pinned"),
    ("device_bytes_held", "device held"),
    ("device_allocated_bytes", "device allocated"),
    ("rss_bytes", "RSS"),
)
_DESCRIPTIVE = {"area", "case", "checks", "guarantees"}


@dataclass
class Row:
    """One case: every junit test case that recorded it (parametrizations), merged."""

    area: str
    case: str
    checks: str
    guarantees: list[str]
    outcomes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    numbers: dict[str, list[str]] = field(default_factory=dict)
    tests: list[str] = field(default_factory=list)
    recorded: bool = True


def _outcome(testcase: ET.Element) -> str:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if testcase.find(tag) is not None:
            return outcome
    return "passed"


def _elsewhere_entry(testcase: ET.Element) -> tuple[str, str, str, str, str] | None:
    path = testcase.get("file", "")
    name = testcase.get("name", "").split("[", 1)[0]
    for entry in ELSEWHERE:
        node_path, node_name = entry[0].split("::")
        if path == node_path and name == node_name:
            return entry
    return None


def read_rows(junit: Path) -> list[Row]:
    """Merge the junit XML's test cases into rows, one per recorded (or known) case."""
    rows: dict[tuple[str, str], Row] = {}
    for testcase in ET.parse(junit).getroot().iter("testcase"):
        properties = {
            prop.get("name", ""): prop.get("value", "") for prop in testcase.iter("property")
        }
        entry = _elsewhere_entry(testcase)
        if "case" in properties:
            key = (properties.get("area", "faults"), properties["case"])
            row = rows.setdefault(
                key,
                Row(
                    key[0],
                    key[1],
                    properties.get("checks", ""),
                    [g for g in properties.get("guarantees", "").split(",") if g],
                ),
            )
        elif entry is not None:
            key = (entry[1], entry[2])
            row = rows.setdefault(
                key, Row(entry[1], entry[2], entry[3], entry[4].split(","), recorded=False)
            )
        else:
            # A test that failed before recording, or one recording nothing: still shown.
            file_name = Path(testcase.get("file", "?")).name
            key = ("faults", f"{file_name}::{testcase.get('name', '?').split('[', 1)[0]}")
            row = rows.setdefault(key, Row(key[0], key[1], "(recorded nothing)", []))
        row.outcomes.append(_outcome(testcase))
        row.seconds += float(testcase.get("time", "0"))
        row.tests.append(f"{testcase.get('file', '?')}::{testcase.get('name', '?')}")
        for name, value in properties.items():
            if name not in _DESCRIPTIVE:
                row.numbers.setdefault(name, []).append(value)
    order = {area: index for index, (area, _) in enumerate(AREAS)}
    return sorted(rows.values(), key=lambda row: (order.get(row.area, 99), not row.recorded))


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _value(name: str, values: Iterable[str]) -> str:
    """One number, or its range over the runs of a row; bytes in binary units."""
    items = list(values)
    try:
        numbers = [float(item) for item in items]
    except ValueError:
        distinct = sorted(set(items))
        return " / ".join(distinct)

    def show(number: float) -> str:
        if "bytes" in name:
            return _bytes(number)
        return str(int(number)) if number == int(number) else f"{number:g}"

    low, high = show(min(numbers)), show(max(numbers))
    return low if low == high else f"{low} to {high}"


def _numbers(row: Row) -> str:
    if not row.recorded:
        return "—"
    numbers = dict(row.numbers)
    parts: list[str] = []
    for name, label in (("steps", "steps"), ("faults_injected", "faults injected")):
        if name in numbers:
            total = sum(int(float(value)) for value in numbers.pop(name))
            parts.append(f"{label} {total}")
    for name, label in LEVELS:
        before = numbers.pop(f"{name}_before", None)
        after = numbers.pop(f"{name}_after", None)
        if before is not None and after is not None:
            parts.append(f"{label} {_value(name, before)} → {_value(name, after)}")
        elif after is not None:
            parts.append(f"{label} after {_value(name, after)}")
    for name, values in numbers.items():
        label = name.replace("_bytes", "").replace("_", " ")
        parts.append(f"{label} {_value(name, values)}")
    return "; ".join(parts) if parts else "—"


def _outcome_cell(row: Row) -> str:
    runs = len(row.outcomes)
    passed = row.outcomes.count("passed")
    skipped = row.outcomes.count("skipped")
    bad = runs - passed - skipped
    if bad:
        return f"**FAILED** {bad}/{runs}"
    if skipped == runs:
        return "skipped"
    suffix = f" ({passed}/{runs} runs)" if runs > 1 else ""
    return f"pass{suffix}" + (f", {skipped} skipped" if skipped else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _area_tables(rows: list[Row], heading: str) -> list[str]:
    """One table per area (``heading`` is the Markdown heading level), in ``AREAS`` order."""
    lines: list[str] = []
    for area, title in AREAS:
        area_rows = [row for row in rows if row.area == area]
        if not area_rows:
            continue
        lines += [
            f"{heading} {title}",
            "",
            "| case | what is checked | outcome | numbers |",
            "| --- | --- | --- | --- |",
        ]
        for row in area_rows:
            lines.append(
                f"| {_cell(row.case)} | {_cell(row.checks)} | {_outcome_cell(row)} | "
                f"{_cell(_numbers(row))} |"
            )
        lines.append("")
    return lines


def _gpu_section(gpu_junit: Path | None) -> list[str]:
    """The GPU run: its recorded rows with numbers, then every other GPU test and its outcome."""
    lines = [
        "## On a GPU",
        "",
        "The rows above come from a CPU run: the engine's bookkeeping runs through "
        "`matepoint.testing.CPUTestTransport`, which defers every copy to an explicit sync point "
        "and poisons what is read too early. The rows below come from a GPU run of the tests "
        "marked `gpu` (`nox -s gpu -- --record` writes the junit XML this section reads): "
        "the same faults through the CUDA transport, where copies run on a real side stream, "
        "originals go back to the caching allocator and out-of-memory errors come from the "
        "allocator itself, plus the race probes (the side stream delayed before each copy, a "
        "contended link) and device memory flat in depth. *device allocated* is "
        "`torch.cuda.memory_allocated()` after `empty_cache()`.",
        "",
    ]
    info: dict[str, object] = {}
    if GPU_RESULTS.is_file():
        info = json.loads(GPU_RESULTS.read_text(encoding="utf-8"))
    if gpu_junit is None or not gpu_junit.is_file():
        lines += ["No GPU run is recorded in `docs/_data/gpu-reliability.xml`.", ""]
        return lines
    rows = read_rows(gpu_junit)
    runs = [outcome for row in rows for outcome in row.outcomes]
    failed = sum(1 for outcome in runs if outcome in ("failed", "error"))
    skipped = runs.count("skipped")
    where = info.get("machine") or "a GPU machine"
    when = f" on {info['date']}" if "date" in info else ""
    lines += [
        f"- Run: {where}, torch {info.get('torch', '?')}{when} "
        f"([`_data/gpu-reliability.xml`](_data/gpu-reliability.xml)).",
        f"- {len(runs)} test runs: {len(runs) - failed - skipped} passed, {failed} failed, "
        f"{skipped} skipped" + (f", at commit {info['code']}." if "code" in info else "."),
        *([f"- {info['note']}"] if "note" in info else []),
        "",
    ]
    recorded = [row for row in rows if row.checks != "(recorded nothing)"]
    lines += _area_tables(recorded, "###")
    others = [row for row in rows if row.checks == "(recorded nothing)"]
    if others:
        lines += [
            "### Race probes and other GPU tests",
            "",
            "| test | outcome |",
            "| --- | --- |",
        ]
        lines += [f"| `{_cell(row.case)}` | {_outcome_cell(row)} |" for row in others]
        lines.append("")
    return lines


def render(
    rows: list[Row], environment: dict[str, str], seconds: float, gpu_junit: Path | None = None
) -> str:
    """The Markdown page."""
    runs = [outcome for row in rows for outcome in row.outcomes]
    failed = sum(1 for outcome in runs if outcome in ("failed", "error"))
    skipped = runs.count("skipped")
    steps = sum(int(float(v)) for row in rows for v in row.numbers.get("steps", []))
    faults = sum(int(float(v)) for row in rows for v in row.numbers.get("faults_injected", []))
    lines = [
        "# Reliability",
        "",
        "<!-- Generated by tools/reliability_report.py (nox -s reliability-report) from one test "
        "run. Do not edit by hand: run the session again. -->",
        "",
        "What happens when a training step goes wrong, or is given something unusual, and what "
        "matepoint guarantees afterwards. Every row below is a test that ran to produce this page; "
        "the numbers are the ones the tests recorded.",
        "",
        f"- Run: {environment['date']}, torch {environment['torch']}, Python "
        f"{environment['python']}, on {environment['machine']}.",
        f"- {len(runs)} test runs in {len(rows)} cases: {len(runs) - failed - skipped} passed, "
        f"{failed} failed, {skipped} skipped, in {seconds:.1f} s.",
        f"- {steps} training steps and {faults} injected faults recorded.",
        "",
        "Memory levels are read after `gc.collect()` from `matepoint.stats()`: live records "
        "(offloaded inputs some graph still holds), pool in use / pinned (host blocks), device "
        "held (originals the engine still references); RSS is the process's resident memory. "
        "*before* is after a first good step, *after* is after the fault and the recovery step. "
        "A range (a to b) spans the parametrized runs of a case (completion modes, pipeline, "
        "reentrant).",
        "",
        "## Guarantees",
        "",
    ]
    for key, statement in GUARANTEES.items():
        backing = [row for row in rows if key in row.guarantees]
        passed = sum(row.outcomes.count("passed") for row in backing)
        broken = [row.case for row in backing if _outcome_cell(row).startswith("**FAILED")]
        if broken:
            status = "**not shown in this run**: failing " + "; ".join(broken)
        elif passed == 0:
            status = "**not shown in this run**: no test ran"
        else:
            status = f"shown by {passed} passing runs of {len(backing)} cases"
        lines.append(f"- **{key}**: {statement} ({status}.)")
    lines.append("")
    lines += _area_tables(rows, "##")
    other = [row for row in rows if row.area not in dict(AREAS)]
    if other:
        lines += ["## Other", "", "| case | outcome |", "| --- | --- |"]
        lines += [f"| {_cell(row.case)} | {_outcome_cell(row)} |" for row in other]
        lines.append("")
    lines += [
        "Rows with numbers come from `test_reliability.py` and `test_faults_and_inputs.py` "
        "(matepoint-core); rows without come from the parity, engine and pool suites, run in the "
        "same session.",
        "",
    ]
    lines += _gpu_section(gpu_junit)
    return "\n".join(lines)


def _environment() -> dict[str, str]:
    import torch  # the tests' torch: this script runs in their environment

    machine = f"CPU ({platform.machine() or 'unknown architecture'})"
    if not torch.cuda.is_available():
        machine += ", no GPU"
    return {
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "machine": machine,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }


def run_tests(junit: Path, slow: bool, extra: list[str]) -> int:
    """Run the reliability tests into ``junit``; return pytest's exit status."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-o",
        "junit_family=xunit1",  # keeps record_property values
        f"--junitxml={junit}",
        *(["--run-slow"] if slow else []),
        *RECORDING_FILES,
        *(entry[0] for entry in ELSEWHERE),
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the page to write")
    parser.add_argument("--no-slow", action="store_true", help="leave out the long soak")
    parser.add_argument("--junit", type=Path, help="render this junit XML, run nothing")
    parser.add_argument(
        "--gpu-junit",
        type=Path,
        default=GPU_JUNIT,
        help="a GPU run's junit XML for the 'On a GPU' section (default: %(default)s)",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reliability-") as folder:
        junit = args.junit or Path(folder) / "reliability.xml"
        status = 0
        if args.junit is None:
            status = run_tests(junit, slow=not args.no_slow, extra=args.pytest_args)
            if status not in (0, 1):  # interrupted, usage or collection error: no page
                print(f"pytest exited with {status}; {args.out} not written", file=sys.stderr)
                return status
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        seconds = sum(float(suite.get("time", "0")) for suite in suites)
        page = render(read_rows(junit), _environment(), seconds, args.gpu_junit)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
