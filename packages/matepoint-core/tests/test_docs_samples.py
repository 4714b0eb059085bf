"""Every code block of README.md and docs/*.md runs, and every printed sample matches the code.

Docs drift silently: a renamed row in a report, an argument that no longer exists, a table that
``print(plan)`` stopped printing. These tests read the pages as a reader does and fail on any of
that. The rules a page follows (see Note [Docs code blocks]):

- A ``python`` block runs. The blocks of one page share one namespace, in page order, as a reader
  who pastes them one after the other would; each page starts from a fresh namespace, plus the
  page's entry in ``PAGE_SETUP`` (the names a snippet assumes, such as ``model`` or ``loader``,
  small enough for a CPU).
- A ``text`` block that follows a python block (no other block between) is that block's output,
  compared with what the block prints now. ``<name>`` in the sample stands for any value on that
  line (a template, as the report's); numbers of milliseconds or seconds are timings and may
  differ. Everything else must match exactly.
- A python block starting with ``>>>`` (or a ``pycon`` block) is a doctest.
- A block that comments ``# warns`` must give a ``MatepointDeprecationWarning``; any other block
  must not warn at all (pytest.ini turns warnings into errors). A block that comments
  ``# raises Name`` must raise ``Name`` (or a subclass).
- Every other block (shell commands, configuration files, diagrams) carries
  ``<!-- not-run: reason -->`` as the last line before its fence, and a block too slow for the
  default run carries ``<!-- slow: reason -->`` (it runs with ``--run-slow``).

The pages are read from the repository the test file lies in; an installed copy of the tests
without the docs beside it skips.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import doctest
import io
import re
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import matepoint
from matepoint.testing import CPUTestTransport, use_transport
from matepoint_compat import TORCH_VERSION, MatepointDeprecationWarning

# Note [Docs code blocks]
# A block's role comes from its fence's info string and the marker comment on the line before
# it; nothing is inferred from its content except the doctest prompt and the `# warns` and
# `# raises Name` comments. A block nobody marked and the test cannot run is a failure, so a new
# shell snippet or diagram has to say why it does not run rather than slip through.

REPO_ROOT = Path(__file__).resolve().parents[3]
PAGES = tuple(
    sorted(
        str(path.relative_to(REPO_ROOT))
        for path in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md")]
        if path.is_file()
    )
)

pytestmark = pytest.mark.skipif(
    not (REPO_ROOT / "docs").is_dir() or not (REPO_ROOT / "README.md").is_file(),
    reason="the docs are not beside these tests (an installed copy of the tests)",
)

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|slow):\s*(?P<reason>.*?)\s*-->\s*$")
RAISES = re.compile(r"#\s*raises\s+(?P<name>\w+)")
WARNS = re.compile(r"#\s*warns\b")
PLACEHOLDER = re.compile(r"<[a-z_][a-z0-9_]*>")
# A timing: a number followed by a unit of time. The unit stays, so "3.2 ms" cannot match "3.2 s".
TIMING = re.compile(r"\d+(?:\.\d+)?(?= ?(?:ms|s)\b)")

# Names a page's snippets take for granted, defined before its first block (small, CPU-sized).
_TRAINING_SETUP = """
import torch
import matepoint


class Block(torch.nn.Module):
    def __init__(self, width, is_small=False):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.is_small = is_small

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


class Model(torch.nn.Module):
    def __init__(self, depth=4, width=256):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, is_small=i % 2 == 1) for i in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = matepoint.checkpoint(block, x)
        return x


torch.manual_seed(0)
model = Model()
block = model.blocks[0]
batch = torch.randn(1024, 256)
x = torch.randn(1024, 256, requires_grad=True)
loader = [torch.randn(1024, 256) for _ in range(11)]
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)


class _Logger:
    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(row)


logger = _Logger()
"""

PAGE_SETUP: dict[str, str] = {
    "docs/configuration.md": _TRAINING_SETUP,
    "docs/faq.md": _TRAINING_SETUP,
    "docs/integrations.md": _TRAINING_SETUP,
    "docs/how-it-works.md": """
import torch
import matepoint

h = torch.randn(512, 512, requires_grad=True)
t1 = torch.randn(512, 512)
t2 = torch.randn(512, 512)
ctx = {"latent": t1, "mask": t2, "scale": 0.5}
""",
}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its info string, its text and its marker."""

    page: str
    line: int
    info: str
    source: str
    not_run: str | None = None
    slow: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def is_doctest(self) -> bool:
        return self.language == "pycon" or (
            self.language == "python" and self.source.lstrip().startswith(">>>")
        )

    @property
    def is_python(self) -> bool:
        return self.language == "python" and not self.is_doctest


def parse_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown page, in order, each with the marker before its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and lines[end].strip() == fence
        ):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}:{index + 1}: the fence opened here is never closed")
        body = [
            line[len(indent) :] if line.startswith(indent) else line
            for line in lines[index + 1 : end]
        ]
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        marker = MARKER.match(previous)
        kind = marker["kind"] if marker else None
        reason = marker["reason"] if marker else None
        if marker is not None and not reason:
            raise AssertionError(f"{page}:{index + 1}: the {kind} marker gives no reason")
        blocks.append(
            Block(
                page=page,
                line=index + 1,
                info=opening["info"].strip(),
                source=textwrap.dedent("\n".join(body)) + "\n",
                not_run=reason if kind == "not-run" else None,
                slow=reason if kind == "slow" else None,
            )
        )
        index = end + 1
    return blocks


def output_samples(blocks: list[Block]) -> dict[int, Block]:
    """Map each run python block's index to the ``text`` block that shows its output, if any."""
    samples = {}
    for index in range(1, len(blocks)):
        before, block = blocks[index - 1], blocks[index]
        if block.language == "text" and block.not_run is None and before.is_python:
            samples[index - 1] = block
    return samples


def unmarked_blocks(blocks: list[Block]) -> list[str]:
    """Blocks the test cannot run that say nothing about why (Note [Docs code blocks])."""
    sample_blocks = set(map(id, output_samples(blocks).values()))
    problems = []
    for block in blocks:
        if block.not_run is not None or block.is_python or block.is_doctest:
            continue
        if id(block) in sample_blocks:
            continue
        if block.language == "text" and block.slow is not None:
            continue
        problems.append(
            f"{block.where}: a ```{block.info or '(no info string)'} block that is neither run "
            "nor marked <!-- not-run: reason -->"
        )
    return problems


def _normalize(text: str) -> list[str]:
    return [TIMING.sub("<time>", line.rstrip()) for line in text.strip("\n").splitlines()]


def _line_pattern(sample_line: str) -> re.Pattern[str]:
    parts = PLACEHOLDER.split(sample_line)
    return re.compile(".+?".join(re.escape(part) for part in parts))


def sample_mismatch(sample: str, printed: str) -> str | None:
    """None if ``printed`` matches the ``sample``, else a unified diff that shows where not."""
    want, got = _normalize(sample), _normalize(printed)
    if len(want) == len(got) and all(
        _line_pattern(expected).fullmatch(actual)
        for expected, actual in zip(want, got, strict=True)
    ):
        return None
    # A printed line that a sample line matches (placeholders, timings) shows as that sample
    # line, so that the diff points at the lines that really differ.
    shown = [
        next((expected for expected in want if _line_pattern(expected).fullmatch(actual)), actual)
        for actual in got
    ]
    return "\n".join(
        difflib.unified_diff(want, shown, "docs sample", "printed now", lineterm="", n=2)
    )


def _expected_exception(block: Block) -> str | None:
    match = RAISES.search(block.source)
    return match["name"] if match else None


def _run_python(block: Block, namespace: dict[str, Any]) -> str:
    """Run one python block in ``namespace``; return what it printed."""
    code = compile(block.source, block.where, "exec")
    printed = io.StringIO()
    raises = _expected_exception(block)
    warns = WARNS.search(block.source) is not None
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(printed))
        if warns:
            stack.enter_context(pytest.warns(MatepointDeprecationWarning))
        try:
            exec(code, namespace)
        except Exception as error:
            if raises is None:
                raise
            names = [cls.__name__ for cls in type(error).__mro__]
            if raises not in names:
                raise AssertionError(
                    f"{block.where}: the block says it raises {raises}, it raised "
                    f"{type(error).__name__}: {error}"
                ) from error
        else:
            assert raises is None, f"{block.where}: the block says it raises {raises}, it did not"
    return printed.getvalue()


def _run_doctest(block: Block, namespace: dict[str, Any]) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.source, namespace, block.where, block.page, block.line)
    output: list[str] = []
    runner = doctest.DocTestRunner(verbose=False)
    result = runner.run(test, out=output.append, clear_globs=False)
    if result.failed:
        raise AssertionError("".join(output))


@contextlib.contextmanager
def _page_environment() -> Iterator[None]:
    """The CPU test transport, so that snippets offload on a machine without a GPU.

    The process-wide settings and stats are the core tests' autouse fixture's to restore; the
    0.1.x global a page may set (quickstart.md sets ``matepoint.NOPIPELINE``) is removed here.
    """
    try:
        with use_transport(CPUTestTransport()):
            yield
    finally:
        vars(matepoint).pop("NOPIPELINE", None)


PAGE_MODULE = "matepoint_docs_page"


@contextlib.contextmanager
def _page_module() -> Iterator[dict[str, Any]]:
    """A module for the page's blocks to run in, importable by name while they run.

    Like a script's ``__main__``: classes and functions a block defines belong to a module that
    ``sys.modules`` knows (Dynamo imports the module of the code it traces). At the end the
    namespace is emptied, also when a block fails: a failed test's traceback outlives it (pytest
    keeps it for post-mortem debugging), and with it a model and the autograd graph of its last
    step, offload records included, would stay alive into the next tests.
    """
    module = types.ModuleType(PAGE_MODULE)
    sys.modules[PAGE_MODULE] = module
    try:
        yield module.__dict__
    finally:
        del sys.modules[PAGE_MODULE]
        module.__dict__.clear()


def run_page(page: str, text: str, *, run_slow: bool) -> list[str]:
    """Run a page's blocks in order; return the blocks skipped as slow."""
    blocks = parse_blocks(text, page)
    samples = output_samples(blocks)
    skipped = []
    with _page_environment(), _page_module() as namespace:
        if page in PAGE_SETUP:
            exec(compile(PAGE_SETUP[page], f"<setup of {page}>", "exec"), namespace)
        for index, block in enumerate(blocks):
            if block.not_run is not None or not (block.is_python or block.is_doctest):
                continue
            if block.slow is not None and not run_slow:
                skipped.append(f"{block.where} ({block.slow})")
                continue
            if block.is_doctest:
                _run_doctest(block, namespace)
                continue
            printed = _run_python(block, namespace)
            if index in samples:
                mismatch = sample_mismatch(samples[index].source, printed)
                if mismatch is not None:
                    raise AssertionError(
                        f"{samples[index].where}: the sample is not what the block above it "
                        f"prints now:\n{mismatch}"
                    )
    return skipped


def _read(page: str) -> str:
    return (REPO_ROOT / page).read_text(encoding="utf-8")


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why_not(page: str) -> None:
    problems = unmarked_blocks(parse_blocks(_read(page), page))
    assert not problems, "\n".join(problems)


RUN_PAGES = tuple(
    page
    for page in PAGES
    if any(
        (block.is_python or block.is_doctest) and block.not_run is None
        for block in parse_blocks(_read(page), page)
    )
)


# A page about a feature of newer torch says so once, anywhere: <!-- needs-torch: 2.11 -->.
NEEDS_TORCH = re.compile(r"<!--\s*needs-torch:\s*(?P<major>\d+)\.(?P<minor>\d+)\s*-->")


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_blocks_run_and_print_their_samples(page: str, request: pytest.FixtureRequest) -> None:
    needed = NEEDS_TORCH.search(_read(page))
    if needed is not None:
        wanted = (int(needed["major"]), int(needed["minor"]))
        if TORCH_VERSION[:2] < wanted:
            pytest.skip(f"{page} needs torch {wanted[0]}.{wanted[1]} (its needs-torch marker)")
    skipped = run_page(page, _read(page), run_slow=bool(request.config.getoption("--run-slow")))
    if skipped:
        pytest.skip(f"slow blocks not run (pass --run-slow): {', '.join(skipped)}")


# The checker itself: a sample that disagrees with the code must fail, whatever part disagrees.

_PAGE = """
Prose.

```python
from matepoint._engine.stats import format_bytes
print(format_bytes(3 << 20))
print("took 12.5 ms")
```

```text
{sample}
```
"""


@pytest.mark.parametrize(
    ("sample", "matches"),
    [
        ("3.00 MiB\ntook 12.5 ms", True),
        ("3.00 MiB\ntook 0.3 ms", True),  # a timing may differ
        ("<size>\ntook 1 ms", True),  # a placeholder stands for any value
        ("3.00 GiB\ntook 12.5 ms", False),
        ("3.00 MiB\ntook 12.5 s", False),  # the unit of a timing may not
        ("3.00 MiB", False),
        ("3.00 MiB\ntook 12.5 ms\n", True),
        ("3.00 MiB\ntook 12.5 ms\nmore", False),
    ],
)
def test_a_sample_that_disagrees_fails(sample: str, matches: bool) -> None:
    page = _PAGE.format(sample=sample)
    if matches:
        run_page("page.md", page, run_slow=False)
    else:
        with pytest.raises(AssertionError, match="is not what the block above it prints now"):
            run_page("page.md", page, run_slow=False)


def test_unmarked_blocks_are_reported() -> None:
    page = "```sh\nrm -rf /\n```\n\n<!-- not-run: a diagram -->\n```text\na -> b\n```\n"
    assert unmarked_blocks(parse_blocks(page, "page.md")) == [
        "page.md:1: a ```sh block that is neither run nor marked <!-- not-run: reason -->"
    ]


def test_warns_and_raises_comments_are_checked() -> None:
    quiet = "```python\nimport matepoint\nmatepoint.NOPIPELINE = True  # warns\n```\n"
    run_page("page.md", quiet, run_slow=False)
    unexpected = "```python\nimport matepoint\nmatepoint.NOPIPELINE = True\n```\n"
    with pytest.raises(MatepointDeprecationWarning):
        run_page("page.md", unexpected, run_slow=False)
    wrong = "```python\nraise KeyError('x')  # raises ValueError\n```\n"
    with pytest.raises(AssertionError, match="says it raises ValueError, it raised KeyError"):
        run_page("page.md", wrong, run_slow=False)


def test_doctest_blocks_are_checked() -> None:
    agrees = "```python\n>>> 1 + 1\n2\n```\n"
    run_page("page.md", agrees, run_slow=False)
    disagrees = "```pycon\n>>> 1 + 1\n3\n```\n"
    with pytest.raises(AssertionError, match=r"Expected:\s+3\s+Got:\s+2"):
        run_page("page.md", disagrees, run_slow=False)
