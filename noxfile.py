"""Every workflow of the matepoint monorepo.

Start with `nox -s tests` (torch 2.13 on the CPU, what CI runs; `-- --run-slow` adds the slow
tests). `nox -t tests` runs the twelve `tests-2.x` sessions instead, one per torch release from
2.4 to 2.15 (`TORCH_VERSIONS=2.4,2.13` narrows them). Where uv is not installed, nox first logs
"uv not found": that is not an error, the sessions that prefer uv use virtualenv instead.
"""

# Notes for maintainers (kept out of the docstring, which `nox -l` prints above the list):
#
# - `tests-2.4` ... `tests-2.15` (tag `tests`) run the same tests against each torch
#   release; `TORCH_VERSIONS=2.4,2.13 nox -t tests` narrows the set. Each prints the installed
#   torch and pytest's counts: the row of that release in `docs/compat.md`.
# - Why two venv backends: ``tests``, ``typecheck``, ``demo`` and ``smoke-wheels`` ask for
#   torch==2.13.0 through plain pip, which takes a CPU build where the machine provides one (the
#   development machines and CI do). uv looks only at the index and would download a CUDA build
#   of several GB there. The per-version matrix uses uv; set ``UV_TORCH_BACKEND=cpu`` (or
#   ``auto``) to have uv pick the matching PyTorch build.

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "uv|virtualenv"


class _ExplainMissingUv(logging.Filter):
    """Reword nox's "uv binary not found." so that it does not read as an error.

    nox looks for uv before creating any environment, also for the sessions that use venv, and
    logs that line when uv is absent. Nothing fails: "uv|virtualenv" falls back to virtualenv.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "uv binary not found.":
            record.msg = (
                "uv not found, which is fine: the sessions that prefer uv (lint, docs, the "
                "tests-2.x matrix) use virtualenv instead (pip install uv to use it)"
            )
            record.args = ()
        return True


logging.getLogger("nox").addFilter(_ExplainMissingUv())
nox.options.error_on_external_run = True
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"

# Order matters: each package is installed after the ones it depends on.
PACKAGES = ("matepoint-compat", "matepoint-core", "matepoint-examples")
IMPORT_NAMES = {
    "matepoint-compat": "matepoint_compat",
    "matepoint-core": "matepoint",
    "matepoint-examples": "matepoint_examples",
}
PACKAGE_DIRS = tuple(f"./packages/{name}" for name in PACKAGES)
# mypy.ini points mypy_path at the three src/ folders; -p then checks each package from source.
MYPY_PACKAGES = tuple(arg for name in PACKAGES for arg in ("-p", IMPORT_NAMES[name]))

# The torch build the CPU sessions use; see the module docstring for why it goes through pip.
DEFAULT_TORCH = "torch==2.13.0"
TORCH_RELEASES = tuple(f"2.{minor}" for minor in range(4, 16))

TEST_DEPS = ("pytest>=8", "pytest-benchmark>=4")
# The Hugging Face integration tests run where these are installed and skip elsewhere.
INTEGRATION_DEPS = ("transformers>=4.40",)
PYTEST_FLAGS = ("--strict-markers", "--strict-config", "-p", "no:cacheprovider")
SMOKE_IMPORT = "import matepoint, matepoint_compat, matepoint_examples"


def _version() -> str:
    """The one release number, read from matepoint-core's pyproject.toml.

    The three distributions are versioned together (core pins compat with ``==``), so the
    release sessions check every artifact name against this single number.
    """
    text = (ROOT / "packages" / "matepoint-core" / "pyproject.toml").read_text(encoding="utf-8")
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError("no [project] version in packages/matepoint-core/pyproject.toml")
    return match.group(1)


def _expected_dist_files() -> set[str]:
    version = _version()
    names = set()
    for name in PACKAGES:
        stem = f"{name.replace('-', '_')}-{version}"
        names |= {f"{stem}-py3-none-any.whl", f"{stem}.tar.gz"}
    return names


def _install_packages(session: nox.Session, torch_spec: str) -> None:
    """Install torch first, then the three packages as wheels (never editable), then smoke-import.

    Installing torch on its own first lets the build pick which torch (CPU, CUDA, a given
    release); the packages' ``torch>=2.4`` is then already satisfied and pulls nothing more.
    Non-editable installs make the tests see what a user gets, package data and all.
    """
    session.install(torch_spec, silent=False)  # the installer's own progress for the download
    # uv reuses its cached build of a local folder until the folder's pyproject.toml changes, and
    # keeps an installed copy of the same version, so a reused environment (`nox -r`) or one
    # built from that cache would test stale sources: rebuild and reinstall the three each time.
    # pip rebuilds local folders on its own.
    fresh = (
        [f"--reinstall-package={name}" for name in PACKAGES] if session.venv_backend == "uv" else []
    )
    session.install(*fresh, *PACKAGE_DIRS, *TEST_DEPS)
    session.run("python", "-c", SMOKE_IMPORT)


def _announce_torch(session: nox.Session, torch_spec: str, purpose: str) -> None:
    """Say that a torch download may follow, and how large, before the long install starts."""
    session.log(
        f"installing {torch_spec} for {purpose}: on Linux, PyPI's torch is the CUDA build, "
        "several GB with its NVIDIA libraries, so the first run downloads for a few minutes "
        "(the installer caches it for the next); where a CPU wheel is at hand it takes that"
    )


def _run_tests(session: nox.Session, torch_spec: str, extra: tuple[str, ...] = ()) -> None:
    """Install against ``torch_spec`` and run the three packages' tests (pytest.ini's testpaths).

    ``extra`` are optional libraries whose integration tests otherwise skip.
    """
    _announce_torch(session, torch_spec, "the tests")
    _install_packages(session, torch_spec)
    if extra:
        session.install(*extra)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("python", "-m", "pytest", *PYTEST_FLAGS, "--benchmark-disable", *session.posargs)


@nox.session(venv_backend="venv")
def tests(session: nox.Session) -> None:
    """Run the tests on torch 2.13.0 (CPU) with transformers; `-- --run-slow` adds the slow ones."""
    _run_tests(session, DEFAULT_TORCH, extra=INTEGRATION_DEPS)


def _wanted_torch_releases() -> set[str] | None:
    raw = os.environ.get("TORCH_VERSIONS", "").strip()
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _register_matrix_session(release: str) -> None:
    def matrix_session(session: nox.Session) -> None:
        wanted = _wanted_torch_releases()
        if wanted is not None and release not in wanted:
            session.skip(f"torch {release} is not in TORCH_VERSIONS={os.environ['TORCH_VERSIONS']}")
        _run_tests(session, f"torch=={release}.*")

    matrix_session.__doc__ = f"Run the tests against the newest torch {release}.x release."
    nox.session(
        name=f"tests-{release}",
        tags=["tests", "tests-matrix"],
        default=False,
        venv_backend="uv|virtualenv",
    )(matrix_session)


for _release in TORCH_RELEASES:
    _register_matrix_session(_release)


def _installed_torch(session: nox.Session) -> str:
    """The version of the torch installed in the current environment, or a clear error."""
    try:
        out = session.run(
            "python",
            "-c",
            "import torch; print(torch.__version__)",
            external=True,
            silent=True,
        )
    except CommandFailed:
        session.error(
            "this session uses the torch of the current environment and found none: "
            "install the torch build you want to test (pip install torch) and run it again"
        )
    assert isinstance(out, str)
    version = out.strip().splitlines()[-1]
    session.log(f"using the installed torch {version}")
    return version


def _install_beside_current_torch(session: nox.Session, torch_version: str) -> None:
    """Install the packages into the current environment, keeping the torch it already has.

    GPU machines come with a CUDA build of torch that matches their driver; the session must
    test that build, not replace it. Asking pip for exactly the installed version makes any
    attempt to change it fail instead of downloading another build.
    """
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        f"torch=={torch_version}",
        *PACKAGE_DIRS,
        *TEST_DEPS,
        external=True,
    )
    session.run("python", "-c", SMOKE_IMPORT, external=True)


def _require_cuda(session: nox.Session) -> None:
    try:
        session.run(
            "python",
            "-c",
            "import sys, torch; sys.exit(0 if torch.cuda.device_count() > 0 else 1)",
            external=True,
            silent=True,
        )
    except CommandFailed:
        session.error("this session needs a CUDA device, and torch sees none")


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """Run the tests marked `gpu` with the current environment's (CUDA) torch.

    Arguments pass through to pytest: `-- --run-slow` adds the long GPU soak.
    """
    torch_version = _installed_torch(session)
    _require_cuda(session)
    _install_beside_current_torch(session, torch_version)
    session.run(
        "python",
        "-m",
        "pytest",
        *PYTEST_FLAGS,
        "--benchmark-disable",
        "-m",
        "gpu",
        *session.posargs,
        external=True,
    )


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Run `matepoint-bench` with the current environment's torch; arguments pass through."""
    _install_beside_current_torch(session, _installed_torch(session))
    session.run("matepoint-bench", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """Check style and formatting with ruff (ruff.toml)."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", *session.posargs, ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="venv")
def typecheck(session: nox.Session) -> None:
    """Run `mypy --strict` over the three source trees (mypy.ini)."""
    session.install(DEFAULT_TORCH)
    session.install("mypy>=1.10", "rich>=13", "matplotlib>=3.7", *TEST_DEPS)
    session.run("mypy", "--strict", *MYPY_PACKAGES, *session.posargs)


@nox.session(venv_backend="venv")
def demo(session: nox.Session) -> None:
    """Install torch 2.13.0 and the packages, run `matepoint-demo`; arguments pass through."""
    _announce_torch(session, DEFAULT_TORCH, "the demo")
    _install_packages(session, DEFAULT_TORCH)
    session.run("matepoint-demo", *session.posargs)


@nox.session(name="bench-micro", venv_backend="venv", default=False)
def bench_micro(session: nox.Session) -> None:
    """Per-call CPU cost of matepoint vs torch's checkpoint, and the pool (pytest-benchmark)."""
    _install_packages(session, DEFAULT_TORCH)
    session.run(
        "python",
        "-m",
        "pytest",
        *PYTEST_FLAGS,
        "packages/matepoint-core/benchmarks",
        "--benchmark-only",
        "--benchmark-columns=median,mean,stddev,rounds",
        "--benchmark-sort=name",
        *session.posargs,
    )


def _build_into_dist(session: nox.Session) -> None:
    """Build every package's sdist and wheel into an empty dist/, check them, check the names."""
    if DIST.exists() and any(DIST.iterdir()):
        session.error("dist/ is not empty: remove it before building a release")
    session.install("build>=1.2", "twine>=6.1")
    for package_dir in PACKAGE_DIRS:
        # An sdist first, then the wheel from that sdist: proves the sdist is complete.
        session.run("python", "-m", "build", "--outdir", str(DIST), package_dir)
    built = sorted(path.name for path in DIST.iterdir())
    session.run("twine", "check", "--strict", *(str(DIST / name) for name in built))
    expected = _expected_dist_files()
    if set(built) != expected:
        missing = sorted(expected - set(built))
        extra = sorted(set(built) - expected)
        session.error(f"dist/ does not hold the expected files: missing {missing}, extra {extra}")
    session.log(f"dist/ holds exactly: {', '.join(built)}")


@nox.session(venv_backend="venv")
def build(session: nox.Session) -> None:
    """Build the six release files into dist/ (refuses a non-empty dist/) and check them."""
    _build_into_dist(session)


SMOKE_WHEELS = """
import importlib.metadata as md
import warnings

import torch

import matepoint
import matepoint_compat
import matepoint_examples

expected = {expected!r}
for dist in ("matepoint-compat", "matepoint-core", "matepoint-examples"):
    got = md.version(dist)
    assert got == expected, f"{{dist}} is {{got}}, expected {{expected}}"

from matepoint import checkpoint

torch.manual_seed(0)
block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
x = torch.randn(4, 8, requires_grad=True)
checkpoint(block, x).sum().backward()
got = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
x.grad = None
block.zero_grad(set_to_none=True)
block(x).sum().backward()
want = [x.grad] + [p.grad for p in block.parameters()]
assert all(torch.equal(a, b) for a, b in zip(got, want)), "gradients differ from the plain block"

# Legacy 0.1.x code: setting the module global must still work and warn.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    matepoint.NOPIPELINE = True
assert any(issubclass(w.category, FutureWarning) for w in caught), [str(w) for w in caught]
print("smoke-wheels: ok, version", expected, "torch", torch.__version__)
"""


@nox.session(name="smoke-wheels", venv_backend="venv")
def smoke_wheels(session: nox.Session) -> None:
    """Install the wheels from dist/ into a fresh environment and exercise them."""
    expected = _expected_dist_files()
    wheels = sorted(DIST / name for name in expected if name.endswith(".whl"))
    missing = [wheel.name for wheel in wheels if not wheel.is_file()]
    if missing:
        session.error(f"dist/ lacks {missing}: run `nox -s build` first")
    session.install(DEFAULT_TORCH)
    session.install(*(str(wheel) for wheel in wheels))
    # Run from outside the work tree, so nothing can import from the sources by accident.
    tmp = Path(session.create_tmp())
    script = tmp / "smoke_wheels.py"
    script.write_text(SMOKE_WHEELS.format(expected=_version()), encoding="utf-8")
    session.chdir(tmp)
    session.run("python", script.name)


@nox.session(name="publish-testpypi", venv_backend="venv", default=False)
def publish_testpypi(session: nox.Session) -> None:
    """Build, check and upload the release to TestPyPI; `-- --dry-run` stops before uploading.

    Credentials come from the environment only: TWINE_PASSWORD holds an API token and
    TWINE_USERNAME is `__token__`. They are never put on a command line, so never logged.
    """
    dry_run = "--dry-run" in session.posargs
    unknown = [arg for arg in session.posargs if arg != "--dry-run"]
    if unknown:
        session.error(f"unknown arguments {unknown}; the only one is --dry-run")
    if not dry_run and not os.environ.get("TWINE_PASSWORD"):
        session.error(
            "TWINE_PASSWORD is not set: export a TestPyPI API token as TWINE_PASSWORD "
            "(TWINE_USERNAME=__token__), or pass -- --dry-run"
        )
    if not dry_run and os.environ.get("TWINE_USERNAME", "__token__") != "__token__":
        session.error("TWINE_USERNAME must be __token__ (TestPyPI takes API tokens only)")
    _build_into_dist(session)
    files = [str(DIST / name) for name in sorted(_expected_dist_files())]
    if dry_run:
        session.log(f"dry run: would upload {len(files)} files to testpypi")
        return
    session.run(
        "twine",
        "upload",
        "--non-interactive",
        "--repository",
        "testpypi",
        *files,
        env={"TWINE_USERNAME": "__token__"},
    )


# Modules whose public names docs/api.md documents one directive each (matepoint_compat is one
# directive for the whole module, which cannot miss a name).
API_MODULES = {
    "matepoint": "packages/matepoint-core/src/matepoint/__init__.py",
    "matepoint.testing": "packages/matepoint-core/src/matepoint/testing.py",
}


def _undocumented_names() -> list[str]:
    """The names in API_MODULES' ``__all__`` that docs/api.md has no ``::: name`` for."""
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: ([\w.]+)$", page, flags=re.MULTILINE))
    missing = []
    for module, path in API_MODULES.items():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and "__all__" in [
                getattr(target, "id", None) for target in node.targets
            ]:
                names = ast.literal_eval(node.value)
                missing += [f"{module}.{name}" for name in names]
    return [name for name in missing if name not in documented]


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation with `mkdocs build --strict` into site/ (open site/index.html)."""
    missing = _undocumented_names()
    if missing:
        session.error(f"docs/api.md has no `::: NAME` directive for {', '.join(missing)}")
    # mkdocstrings reads the API page's docstrings from the src/ folders (mkdocs.yml), so the
    # build needs neither torch nor the packages installed; ruff formats the signatures.
    session.install(
        "mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6"
    )
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})
    site = _site_dir(session.posargs)
    session.log(f"documentation site written to {site}: open {site / 'index.html'} in a browser")


def _site_dir(mkdocs_args: list[str]) -> Path:
    """Where `mkdocs build` wrote the site: mkdocs.yml's site/, or the -d/--site-dir given."""
    site = ROOT / "site"
    for index, arg in enumerate(mkdocs_args):
        if arg in ("-d", "--site-dir") and index + 1 < len(mkdocs_args):
            site = Path(mkdocs_args[index + 1])
        elif arg.startswith("--site-dir="):
            site = Path(arg.split("=", 1)[1])
    return site.resolve()


def _clean(session: nox.Session, *paths: Path) -> None:
    for path in paths:
        if path.exists():
            session.log(f"removing {path.relative_to(ROOT)}")
            shutil.rmtree(path)


@nox.session(venv_backend="none", default=False)
def clean(session: nox.Session) -> None:
    """Remove dist/ and site/ (what `build` and `docs` leave behind)."""
    _clean(session, DIST, ROOT / "site")
