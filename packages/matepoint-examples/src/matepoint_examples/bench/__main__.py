"""``python -m matepoint_examples.bench``: the same as the ``matepoint-bench`` command."""

from matepoint_examples.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
