"""Pair matepoint's step against another revision of matepoint, in one process, step by step.

A change that should not change speed (a move of modules, a refactor) is checked the way the
benchmark checks strategies (``matepoint_examples.bench._paired``): one model, one optimizer,
strategies alternating step by step, the median of per-round ratios with its interquartile
range. The other revision runs beside this one under other package names: ``prepare`` copies
its ``matepoint`` and ``matepoint_compat`` sources out of git and renames them
(``matepoint_before``, ``matepoint_compat_before``, and the planner's operator namespace), so
both import side by side, each with its own engines, streams and pools.

From the repository root, with the three packages importable (installed, or on PYTHONPATH):

    python tools/compare_revisions.py prepare --revision REV --out build/before
    python tools/compare_revisions.py run --before build/before --workload nanochat12

``run`` prints each strategy's paired ratio to torch's checkpoint, and this revision's paired
ratio to the other's, and writes the rows as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "matepoint": "packages/matepoint-core/src/matepoint",
    "matepoint_compat": "packages/matepoint-compat/src/matepoint_compat",
}
SUFFIX = "_before"
# Every name the two copies would otherwise share: the import packages and the operator
# namespaces they register with torch.library at import.
_SHARED_NAMES = re.compile(r"\b(matepoint_compat|matepoint_plan|matepoint)\b")
BEFORE = "matepoint-before"


def prepare(revision: str, out: Path) -> None:
    """Copy ``revision``'s two packages into ``out`` under renamed packages."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision, *SOURCES.values()],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            for package, source in SOURCES.items():
                if member.name.startswith(source + "/"):
                    relative = member.name[len(source) + 1 :]
                    target = out / (package + SUFFIX) / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    data = tar.extractfile(member)
                    assert data is not None
                    content = data.read()
                    if target.suffix == ".py":
                        text = _SHARED_NAMES.sub(r"\1" + SUFFIX, content.decode("utf-8"))
                        content = text.encode("utf-8")
                    target.write_bytes(content)
    commit = subprocess.run(
        ["git", "rev-parse", revision], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    (out / "REVISION").write_text(commit + "\n", encoding="utf-8")
    print(f"{revision} ({commit[:12]}) copied to {out} as matepoint{SUFFIX}")


def _register_before(before: Path) -> str:
    """Add the ``matepoint-before`` strategy: the benchmark's matepoint, from the other copy."""
    sys.path.insert(0, str(before))
    old = importlib.import_module("matepoint" + SUFFIX)
    from matepoint_examples import strategies

    current = strategies.get_strategy("matepoint")

    def checkpoint_before(function: Any, /, *args: Any) -> Any:
        return old.checkpoint(function, *args, use_reentrant=False, pipeline=True)

    strategies.STRATEGIES[BEFORE] = dataclasses.replace(
        current,
        name=BEFORE,
        summary="matepoint.checkpoint of the other revision",
        checkpoint_fn=checkpoint_before,
        stats=None,
        reset_stats=None,
    )
    return (before / "REVISION").read_text(encoding="utf-8").strip()


def _paired_ratio(rows: dict[str, dict[str, Any]], name: str, reference: str) -> list[float]:
    """Per-round ratios of ``name``'s step to ``reference``'s, rounds both completed."""
    ratios = []
    for ours, theirs in zip(rows[name]["times"], rows[reference]["times"], strict=True):
        if ours and theirs and ours.get("step_s") and theirs.get("step_s"):
            ratios.append(ours["step_s"] / theirs["step_s"])
    return ratios


def run(before: Path, workload_name: str, rounds: int, warmup: int, out: Path | None) -> None:
    """Run torch's checkpoint, this matepoint and the other revision's, paired."""
    import torch

    revision = _register_before(before)
    from matepoint_examples._workloads import get_workload
    from matepoint_examples.bench._paired import quartiles, run_paired

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workload = get_workload(workload_name)
    names = ["torch", "matepoint", BEFORE]
    rows = {row["strategy"]: row for row in run_paired(workload, names, device, rounds, warmup)}
    for name in names:
        row = rows[name]
        if row["status"] != "ok":
            print(f"{name}: {row['status']} {row.get('note', '')}")
            continue
        ratio = row.get("ratio")
        spread = f"[{row.get('ratio_q1', 0):.3f}-{row.get('ratio_q3', 0):.3f}]"
        print(f"{name:>18}: step {row['step_time_s'] * 1e3:8.2f} ms, / torch {ratio:.3f} {spread}")
    ratios = _paired_ratio(rows, "matepoint", BEFORE)
    q1, median, q3 = quartiles(ratios)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"this revision / {revision[:12]}: {median:.3f} [{q1:.3f}-{q3:.3f}] over {len(ratios)} "
        f"rounds (mean {statistics.fmean(ratios):.3f}), on {machine}"
    )
    if out is not None:
        report = {"before": revision, "ratio_to_before": [q1, median, q3], "rows": rows}
        out.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    prep = verbs.add_parser("prepare", help="copy another revision under renamed packages")
    prep.add_argument("--revision", required=True)
    prep.add_argument("--out", type=Path, required=True)
    measure = verbs.add_parser("run", help="pair this revision's step against the other's")
    measure.add_argument("--before", type=Path, required=True)
    measure.add_argument("--workload", default="nanochat12")
    measure.add_argument("--rounds", type=int, default=30)
    measure.add_argument("--warmup", type=int, default=3)
    measure.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "prepare":
        prepare(args.revision, args.out)
    else:
        run(args.before, args.workload, args.rounds, args.warmup, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
