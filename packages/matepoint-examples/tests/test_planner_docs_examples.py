"""The worked examples of docs/planner.md print what the page shows.

A worked example is a ``matepoint-plan`` command in a ``sh`` block (marked
``<!-- not-run: ... -->`` for the docs-samples test, which does not run shell commands), then the
table the command prints, as a Markdown table, and, where the text quotes them, a ``text`` block
of lines from the rest of its output (also marked not-run). Here each command runs in-process and
(see Note [Worked examples checked]):

- the Markdown table must have the printed table's rows, in its order, each cell as printed (a
  row label's ``*``, the table's mark for an estimate, is written ``(est.)`` on the page);
- every line of the ``text`` block must be a line of the output, in the same order.

The page is read from the repository the test file lies in; an installed copy of the tests
without the docs beside it skips.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from matepoint._planner.policy import AVAILABLE
from matepoint_examples import plan as plan_cli

# Note [Worked examples checked]
# The page's numbers are the command's, not a summary of them: a cell says "418.75 MiB" where
# the command does, so that a change to the planner (a workspace counted, a rounding) fails here
# instead of leaving the page 64 MiB off. Only the table and the quoted lines are compared; the
# rest of the output (the budget lines, "planned in") may change without touching the page.

REPO_ROOT = Path(__file__).resolve().parents[3]
PAGE = REPO_ROOT / "docs" / "planner.md"

pytestmark = [
    pytest.mark.skipif(
        not PAGE.is_file(), reason="the docs are not beside these tests (an installed copy)"
    ),
    # The examples quote the budget plan, which needs torch's selective checkpointing (2.5+);
    # before it the command prints the options search's line instead.
    pytest.mark.skipif(not AVAILABLE, reason="budget plans need torch 2.5 or newer"),
]

FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
COMMAND = "matepoint-plan"
# Examples that take long enough to leave the default run (seconds on two CPU cores).
SLOW = {"deep96": "96 blocks and a budget search: about 13 s on a CPU"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One worked example: its command's arguments, its table and the lines it quotes."""

    line: int
    argv: tuple[str, ...]
    table: tuple[tuple[str, ...], ...]
    quoted: tuple[str, ...]


def _fenced(lines: list[str], start: int) -> tuple[str, list[str], int]:
    """The block whose fence opens at ``lines[start]``: its language, body and closing index."""
    opening = FENCE.match(lines[start].strip())
    assert opening is not None
    end = start + 1
    while lines[end].strip() != opening[1]:
        end += 1
    return opening[2], lines[start + 1 : end], end


def _cells(row: str, separator: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in row.strip().strip(separator).split(separator))


def parse_examples(text: str) -> list[Example]:
    """Every ``matepoint-plan`` command block of the page with the table and lines after it."""
    lines = text.splitlines()
    examples = []
    index = 0
    while index < len(lines):
        if not FENCE.match(lines[index].strip()):
            index += 1
            continue
        language, body, end = _fenced(lines, index)
        command = " ".join(line.strip() for line in body).strip()
        if language != "sh" or not command.startswith(COMMAND + " "):
            index = end + 1
            continue
        table: list[tuple[str, ...]] = []
        quoted: list[str] = []
        after = end + 1
        # The example's table and quoted lines come before the next example or heading.
        while after < len(lines) and not lines[after].startswith("#"):
            line = lines[after]
            if line.startswith("|"):
                cells = _cells(line, "|")
                if not set("".join(cells)) <= set("-: "):  # not the alignment row
                    table.append(cells)
            elif FENCE.match(line.strip()):
                block_language, block_body, block_end = _fenced(lines, after)
                if block_language == "sh":
                    break
                if block_language == "text":
                    quoted.extend(each.strip() for each in block_body if each.strip())
                after = block_end
            after += 1
        assert table, f"planner.md:{index + 1}: the command has no table after it"
        examples.append(
            Example(
                line=index + 1,
                argv=tuple(shlex.split(command)[1:]),
                table=tuple(table[1:]),  # the header names the strategies
                quoted=tuple(quoted),
            )
        )
        index = end + 1
    return examples


def printed_table(printed: str) -> list[tuple[str, ...]]:
    """The rows of the table the command printed: label, then one cell per strategy."""
    rows = [_cells(line, "│") for line in printed.splitlines() if line.startswith("│")]
    return [(label.rstrip("*").strip(), *cells) for label, *cells in rows]


def _page_label(label: str) -> str:
    return label.removesuffix("(est.)").strip()


def _examples() -> list[pytest.ParameterSet]:
    if not PAGE.is_file():
        return []
    params = []
    for example in parse_examples(PAGE.read_text(encoding="utf-8")):
        model = example.argv[example.argv.index("--model") + 1]
        marks = [pytest.mark.slow] if model in SLOW else []
        params.append(pytest.param(example, marks=marks, id=model))
    return params


def test_the_page_has_worked_examples() -> None:
    models = {
        example.argv[example.argv.index("--model") + 1]
        for example in parse_examples(PAGE.read_text(encoding="utf-8"))
    }
    assert {"nanochat12", "deep96"} <= models


def problems(example: Example, printed: str) -> list[str]:
    """Where the page's table and quoted lines differ from what the command printed."""
    found = []
    page_rows = [(_page_label(label), *cells) for label, *cells in example.table]
    if page_rows != printed_table(printed):
        found.append("the table is not what it prints now")
    output_lines = [line.strip() for line in printed.splitlines()]
    position = 0
    for quoted in example.quoted:
        if quoted not in output_lines[position:]:
            found.append(f"the quoted line {quoted!r} is not in what it prints now (in order)")
            continue
        position = output_lines.index(quoted, position) + 1
    return found


@pytest.mark.parametrize("example", _examples())
def test_worked_example_prints_its_table(
    example: Example, capsys: pytest.CaptureFixture[str]
) -> None:
    status = plan_cli.main(list(example.argv))
    printed = capsys.readouterr().out
    assert status in (0, 1), printed
    where = f"docs/planner.md:{example.line} ({COMMAND} {' '.join(example.argv)})"
    found = problems(example, printed)
    assert not found, f"{where}: " + "; ".join(found) + f"; it prints:\n{printed}"


def test_a_stale_example_is_caught() -> None:
    page = "\n".join(
        [
            "```sh",
            "matepoint-plan --model tiny --budget 1",
            "```",
            "",
            "| | a | b |",
            "| --- | ---: | ---: |",
            "| peak device memory | 1.00 GiB | 2.00 GiB |",
            "| link time, each way (est.) | 0.0 ms | 1.0 ms |",
            "",
            "<!-- not-run: lines of its output -->",
            "```text",
            "  fits",
            "```",
            "",
            "## Next",
            "```sh",
            "matepoint-plan --model other",
            "```",
        ]
    )
    with pytest.raises(AssertionError, match="has no table"):
        parse_examples(page)
    (example,) = parse_examples(page.split("## Next")[0])
    assert example.argv == ("--model", "tiny", "--budget", "1")
    assert example.quoted == ("fits",)
    rows = [
        "│ peak device memory │ 1.00 GiB │ 2.00 GiB │",
        "│ link time, each way* │ 0.0 ms │ {} │",
    ]
    same = "\n".join(rows).format("1.0 ms") + "\n    fits\n"
    assert problems(example, same) == []
    stale = "\n".join(rows).format("1.1 ms") + "\nfits nothing\n"
    assert problems(example, stale) == [
        "the table is not what it prints now",
        "the quoted line 'fits' is not in what it prints now (in order)",
    ]
