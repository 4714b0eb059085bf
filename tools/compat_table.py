"""Build docs/compat.md, the torch compatibility table, from real test runs.

Two commands:

``python tools/compat_table.py env --out FILE``
    Run inside a ``tests-2.X`` session's environment (the noxfile does it before pytest): writes
    the installed torch version, every version gate of ``matepoint_compat`` and the shims those
    gates switch on, as JSON.

``python tools/compat_table.py table [--results DIR] [--gpu FILE] [--out FILE]``
    Run by ``nox -s compat-table``: reads each ``tests-2.X.xml`` (pytest's junit XML) and
    ``tests-2.X.json`` from ``.nox-results/`` and writes ``docs/compat.md``. A release with no
    results reads "not run". The GPU row comes from ``docs/_data/gpu-results.json`` if present::

        {"torch": "2.11.0+cu130", "device": "NVIDIA H200", "passed": 40, "failed": 0,
         "skipped": 2, "date": "2026-12-01", "gates": {"TORCH_2_8_PLUS": true, ...}}

    (``torch``, ``passed``, ``failed`` and ``skipped`` are required; ``errors``, ``seconds``,
    ``device``, ``date``, ``command`` and ``gates`` are optional.)

``python tools/compat_table.py gpu --junit FILE [--out FILE] [--run-command TEXT]``
    Run by ``nox -s gpu -- --record`` on a GPU machine after its pytest run: writes
    ``docs/_data/gpu-results.json`` from that run's junit XML (the counts) and the environment
    (torch, Python, the device's name and how many there are, today's date).

Only the standard library is used by ``table``; ``env`` and ``gpu`` need torch (``env`` also
matepoint_compat).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RELEASES = tuple(f"2.{minor}" for minor in range(4, 16))
GPU_RELEASE = "2.11"

# The shims of matepoint_compat and the gate that switches each one on: (name, gate, active when
# the gate is ...). Where a shim is keyed on a derived flag the flag is named instead of a gate.
SHIMS: tuple[tuple[str, str, bool], ...] = (
    ("hook-stack depth counter (no `_top_saved_tensors_default_hooks`)", "TORCH_2_8_PLUS", False),
    ("torch's own autocast FutureWarning ignored in tests", "TORCH_2_5_PLUS", False),
    ("`early_stop=` via `set_checkpoint_early_stop`", "TORCH_2_9_PLUS", False),
    ("0-element dummy input skipped (`_NoopSaveInputs`)", "TORCH_2_12_PLUS", False),
    ("exact-size pinned blocks via `cudaHostRegister`", "TORCH_2_13_PLUS", False),
    ("failed forward: torch's suspended checkpoint closed first", "TORCH_2_13_PLUS", False),
    ("`respect_saved_tensors_hooks=` rejected (TypeError)", "TORCH_2_14_PLUS", False),
    ("`respect_saved_tensors_hooks=False` passed with `context_fn`", "TORCH_2_14_PLUS", True),
)
GATE_PATTERN = re.compile(r"^TORCH_(\d+)_(\d+)_PLUS$")


def _gate_key(name: str) -> tuple[int, int]:
    match = GATE_PATTERN.match(name)
    assert match is not None
    return int(match.group(1)), int(match.group(2))


def collect_env() -> dict[str, Any]:
    """The installed torch, compat's gates and the shims they switch on (needs torch)."""
    import torch

    import matepoint_compat as compat

    gates = {
        name: bool(getattr(compat, name))
        for name in sorted(
            dir(compat), key=lambda n: _gate_key(n) if GATE_PATTERN.match(n) else (0, 0)
        )
        if GATE_PATTERN.match(name)
    }
    shims = [name for name, gate, when in SHIMS if gate in gates and gates[gate] is when]
    return {
        "torch": torch.__version__,
        "compat": compat.__version__,
        "gates": gates,
        "shims": shims,
        "warning_filters": list(compat.TORCH_WARNING_FILTERS),
    }


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and wall time of one pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            totals[key] += int(suite.get(key, "0"))
        totals["time"] += float(suite.get("time", "0"))
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return {
        "passed": passed,
        "failed": totals["failures"],
        "errors": totals["errors"],
        "skipped": totals["skipped"],
        "seconds": totals["time"],
    }


# Skips that say nothing about the torch release: no GPU, slow tests, optional libraries.
ENVIRONMENT_SKIPS = ("gpu:", "slow:", "could not import", "needs 2 CUDA devices")
VERSION_STRING = re.compile(r"\b\d+\.\d+\.\d+[\w.+]*")


def read_version_skips(path: Path) -> dict[str, int]:
    """How many tests each version-gated skip reason skipped, from one junit XML file.

    Reasons naming the installed build (``torch 2.7.1+cu126's ...``) read ``2.X`` instead, so one
    reason is one row across releases.
    """
    reasons: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for skipped in case.findall("skipped"):
            message = (skipped.get("message") or "").strip()
            if not message or message.startswith(ENVIRONMENT_SKIPS):
                continue
            message = VERSION_STRING.sub("2.X", message)
            reasons[message] = reasons.get(message, 0) + 1
    return reasons


def _env_from_venv(release: str) -> dict[str, Any] | None:
    """Ask the session's own environment (.nox/tests-2-X) when the JSON is missing."""
    python = ROOT / ".nox" / f"tests-{release.replace('.', '-')}" / "bin" / "python"
    if not python.exists():
        return None
    try:
        out = subprocess.run(
            [str(python), str(Path(__file__).resolve()), "env", "--out", "-"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return json.loads(out)  # type: ignore[no-any-return]


def _status(counts: dict[str, Any] | None) -> str:
    if counts is None:
        return "not run"
    return "pass" if counts["failed"] == 0 and counts["errors"] == 0 else "**FAIL**"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _row(
    label: str, env: dict[str, Any] | None, counts: dict[str, Any] | None, gate_names: list[str]
) -> str:
    torch_version = env["torch"] if env else None
    gates = env.get("gates", {}) if env else {}
    marks = ["✓" if gates.get(name) else ("·" if name in gates else "-") for name in gate_names]
    cells = [label, _cell(torch_version), _status(counts)]
    if counts is None:
        cells += ["-", "-", "-", "-"]
    else:
        failed = counts["failed"] + counts.get("errors", 0)
        seconds = counts.get("seconds")
        cells += [
            str(counts["passed"]),
            str(failed),
            str(counts["skipped"]),
            "-" if seconds is None else f"{float(seconds):.0f}",
        ]
    return "| " + " | ".join(cells + marks) + " |"


def build_table(results: Path, gpu_file: Path) -> str:
    envs: dict[str, dict[str, Any] | None] = {}
    counts: dict[str, dict[str, Any] | None] = {}
    skips: dict[str, dict[str, int] | None] = {}
    for release in RELEASES:
        xml_path = results / f"tests-{release}.xml"
        json_path = results / f"tests-{release}.json"
        counts[release] = read_junit(xml_path) if xml_path.is_file() else None
        skips[release] = read_version_skips(xml_path) if xml_path.is_file() else None
        if json_path.is_file():
            envs[release] = json.loads(json_path.read_text(encoding="utf-8"))
        else:
            envs[release] = _env_from_venv(release) if counts[release] else None
    gpu: dict[str, Any] | None = None
    if gpu_file.is_file():
        gpu = json.loads(gpu_file.read_text(encoding="utf-8"))

    gate_names = sorted(
        {name for env in envs.values() if env for name in env.get("gates", {})}
        | {name for _, name, _ in SHIMS},
        key=_gate_key,
    )
    short = [
        name.removeprefix("TORCH_").removesuffix("_PLUS").replace("_", ".") + "+"
        for name in gate_names
    ]
    header = ["torch", "installed", "result", "passed", "failed", "skipped", "seconds", *short]
    lines = [
        "# Torch compatibility",
        "",
        "<!-- Generated by tools/compat_table.py (`nox -s compat-table`); do not edit by hand. -->",
        "",
        "matepoint targets torch 2.4 to 2.15. Each release row is the last recorded run of the",
        "full CPU test suite (`nox -s tests-2.X`: the newest patch release of that minor, CUDA",
        'wheels on a machine without a GPU, so `gpu` tests are skipped); "not run" means no',
        "results were recorded. The GPU row comes from `docs/_data/gpu-results.json`. Gate columns",
        "show `matepoint_compat`'s version gates as the run saw them (✓ true, · false).",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(["---"] * len(header)) + " |",
    ]
    for release in RELEASES:
        lines.append(_row(release, envs[release], counts[release], gate_names))
    gpu_label = f"{GPU_RELEASE} GPU (H200)"
    if gpu is None:
        lines.append(_row(gpu_label, None, None, gate_names))
    else:
        gpu_env = {"torch": gpu.get("torch"), "gates": gpu.get("gates", {})}
        gpu_counts = {
            "passed": int(gpu["passed"]),
            "failed": int(gpu["failed"]),
            "errors": int(gpu.get("errors", 0)),
            "skipped": int(gpu["skipped"]),
            "seconds": gpu.get("seconds"),
        }
        device = gpu.get("device")
        label = gpu_label if not device else f"{GPU_RELEASE} GPU ({device})"
        lines.append(_row(label, gpu_env, gpu_counts, gate_names))
    if gpu is not None and gpu.get("date"):
        lines += [
            "",
            f"GPU run: {gpu['date']}"
            + (f", `{gpu['command']}`" if gpu.get("command") else "")
            + ".",
        ]

    lines += [
        "",
        "## Shims active per release",
        "",
        "Each shim lives in `matepoint_compat` behind the named gate and says in its comment",
        "from which torch on it can be deleted.",
        "",
        "| shim | gate | " + " | ".join(RELEASES) + " |",
        "| --- | --- | " + " | ".join(["---"] * len(RELEASES)) + " |",
    ]
    for name, gate, when in SHIMS:
        cells = []
        for release in RELEASES:
            env = envs[release]
            if env is None:
                cells.append("-")
            else:
                cells.append("on" if name in env.get("shims", []) else "·")
        condition = gate if when else f"not {gate}"
        lines.append(f"| {name} | `{condition}` | " + " | ".join(cells) + " |")
    reasons = sorted({reason for found in skips.values() if found for reason in found})
    if reasons:
        lines += [
            "",
            "## Version-gated skips per release",
            "",
            "Tests skipped behind a version gate, by reason and number of tests: what torch lacks",
            "or gets wrong on that release, and tests of a shim on releases that do not need it",
            "(no-GPU, `slow` and missing-library skips are left out).",
            "",
            "| reason | " + " | ".join(RELEASES) + " |",
            "| --- | " + " | ".join(["---"] * len(RELEASES)) + " |",
        ]
        for reason in reasons:
            cells = []
            for release in RELEASES:
                found = skips[release]
                cells.append("-" if found is None else str(found.get(reason, "·")))
            escaped = reason.replace("|", "\\|")
            lines.append(f"| {escaped} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Regenerate: `nox -t tests-matrix` (or `TORCH_VERSIONS=2.4,2.15 nox -t tests-matrix`),",
        "then `nox -s compat-table`. Results live in `.nox-results/` (not committed).",
        "",
    ]
    return "\n".join(lines)


def gpu_results(junit: Path, command: str) -> dict[str, object]:
    """The GPU row's record: counts from ``junit``, the machine from the running environment."""
    import torch

    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if count else "no CUDA device"
    return {
        "machine": name if count <= 1 else f"{name}, a host with {count}",
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "command": command,
        **read_junit(junit),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("env", help="write this environment's torch and gates as JSON")
    env.add_argument("--out", default="-", help="file to write, - for stdout")
    table = commands.add_parser("table", help="write docs/compat.md from the recorded results")
    table.add_argument("--results", type=Path, default=ROOT / ".nox-results")
    table.add_argument("--gpu", type=Path, default=ROOT / "docs" / "_data" / "gpu-results.json")
    table.add_argument("--out", type=Path, default=ROOT / "docs" / "compat.md")
    gpu = commands.add_parser("gpu", help="write docs/_data/gpu-results.json from a GPU run")
    gpu.add_argument("--junit", type=Path, required=True, help="the GPU run's junit XML")
    gpu.add_argument("--out", type=Path, default=ROOT / "docs" / "_data" / "gpu-results.json")
    gpu.add_argument("--run-command", default="nox -s gpu -- --record", help="how the run was made")
    args = parser.parse_args(argv)
    if args.command == "gpu":
        record = gpu_results(args.junit, args.run_command)
        args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    if args.command == "env":
        text = json.dumps(collect_env(), indent=2) + "\n"
        if args.out == "-":
            sys.stdout.write(text)
        else:
            Path(args.out).write_text(text, encoding="utf-8")
        return 0
    markdown = build_table(args.results, args.gpu)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
