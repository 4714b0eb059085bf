"""The benchmark harness: ``matepoint-bench``, its workers, reports and plots, and the trainer.

Kept apart from what a user reads to learn matepoint (the demo, the integrations, the models and
``matepoint-plan``): this is the machinery behind the numbers in docs/benchmarks.md. Paired step
times and one-process-per-strategy memory (:mod:`~matepoint_examples.bench.cli`, the console
script), the compiled strategies (``_compiled``), the copies-only floor (``_floor``), profiler
traces (``_trace``) and the distributed trainer
(``python -m matepoint_examples.bench.distributed``).

Nothing is imported here: :mod:`matepoint_examples.strategies` takes the compiled and floor
strategies from this package, and the command line imports the strategies, so an import here
would be circular. Run ``matepoint-bench`` or ``python -m matepoint_examples.bench``.
"""
