"""What torch's compile caches did over one compiled strategy's compile step.

A compiled strategy's first step compiles its forward and, lazily, its backward. Whether that
went through AOTAutograd's and inductor's on-disk caches decides how long a later process takes
to compile the same graphs (a warm cache turns minutes into seconds on the deep workloads), so
each compiled row says what the caches did: AOTAutograd's outcome, inductor's FX graph cache's
outcome, and the reasons inductor gave for bypassing its cache. The counts are torch's
process-wide counters (``torch._dynamo.utils.counters``), read at the step's start and end.
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["CompileStepCaches"]

_CACHE_OUTCOMES = ("hit", "miss", "saved", "bypass")


def _autograd_cache_counts() -> dict[str, int]:
    """AOTAutograd's compile-cache lookups and saves in this process so far, by outcome."""
    from torch._dynamo.utils import counters

    return {
        outcome: counters["aot_autograd"][f"autograd_cache_{outcome}"]
        for outcome in _CACHE_OUTCOMES
    }


_FX_GRAPH_CACHE_OUTCOMES = ("hit", "miss", "bypass")


def _fx_graph_cache_counts() -> dict[str, int]:
    """inductor's FX graph cache lookups in this process so far, by outcome.

    AOTAutograd saves a compiled graph only when this cache gave keys for both the forward and
    the backward graph, so a bypass here is why an AOTAutograd miss is not saved.
    """
    from torch._dynamo.utils import counters

    return {
        outcome: counters["inductor"][f"fxgraph_cache_{outcome}"]
        for outcome in _FX_GRAPH_CACHE_OUTCOMES
    }


def _outcomes(before: dict[str, int], now: dict[str, int]) -> str:
    """Join the outcomes whose counts moved since ``before`` with ``+``, or say ``not used``."""
    return "+".join(name for name, count in now.items() if count > before[name]) or "not used"


_CODECACHE_LOGGER = "torch._inductor.codecache"
"""The logger inductor's FX graph cache logs its bypasses on (at INFO)."""

_BYPASS_MESSAGE = re.compile(r"Bypassing FX Graph Cache because '(.*)'", re.DOTALL)
"""inductor's message for a bypass (torch 2.11 and 2.13); the reason is its one argument."""

_REASON_CHARS = 200
"""At most this many characters of a bypass reason are kept (a pickling error can be long)."""

_REASONS_KEPT = 8
"""At most this many distinct bypass reasons are kept per compile step."""


class _BypassReasons(logging.Filter):
    """Collect the reasons inductor gives for bypassing its FX graph cache, while asked to.

    The counters say that inductor bypassed its cache, not why; it says why only in a log
    record at INFO, which torch's default logging drops. While any compiled forward's compile
    step is open, this filter sits on inductor's cache logger, lowered to INFO if it was above.
    A logger's filter sees each record once, before any handler, so it can keep the reason and
    then drop the records that the logger's previous level would have dropped: the user's
    logging prints what it printed before, once. Compile steps of several compiled forwards
    may overlap (one not ended by ``end_compile_step`` stays open until its next call), so one
    filter serves them all, as the process-wide counters do: each step reads the reasons
    collected since it opened.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.open_steps = 0
        self.dropped_below = logging.NOTSET
        self.saved_level: int | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep a bypass reason; pass the record on only if the user's level shows it."""
        try:
            match = _BYPASS_MESSAGE.fullmatch(record.getMessage())
        except Exception:  # a malformed record is logging's to report, not the compile's
            match = None
        if match is not None:
            self.reasons.append(match.group(1))
        return record.levelno >= self.dropped_below

    def open(self) -> int:
        """Start collecting (for one more compile step); return the step's first index."""
        logger = logging.getLogger(_CODECACHE_LOGGER)
        if self.open_steps == 0:
            self.reasons.clear()
            if not logger.isEnabledFor(logging.INFO):
                self.saved_level = logger.level
                self.dropped_below = logger.getEffectiveLevel()
                logger.setLevel(logging.INFO)
            logger.addFilter(self)
        self.open_steps += 1
        return len(self.reasons)

    def close(self, start: int) -> list[str]:
        """End one compile step's collecting; return its distinct reasons, shortened.

        Args:
            start: What :meth:`open` returned for this step.

        Returns:
            The reasons logged since then, each once, in the order first seen.
        """
        reasons = list(dict.fromkeys(r[:_REASON_CHARS] for r in self.reasons[start:]))
        self.open_steps -= 1
        if self.open_steps == 0:
            logger = logging.getLogger(_CODECACHE_LOGGER)
            logger.removeFilter(self)
            if self.saved_level is not None:
                logger.setLevel(self.saved_level)
            self.saved_level = None
            self.dropped_below = logging.NOTSET
            self.reasons.clear()
        return reasons[:_REASONS_KEPT]


_BYPASS_REASONS = _BypassReasons()
"""The one collector of FX graph cache bypass reasons (see :class:`_BypassReasons`)."""


class CompileStepCaches:
    """What the compile caches did between :meth:`start` and :meth:`end` (one compile step).

    ``autograd_cache``: what AOTAutograd's on-disk cache did: ``hit`` (the joint pass and the
    partitioner did not run in this process), ``miss+saved`` (compiled and stored, for the next
    process), ``miss`` alone (compiled, not stored), ``bypass`` (not cacheable), or ``not
    used``. ``fx_graph_cache`` says the same of inductor's FX graph cache (``hit``, ``miss``,
    ``bypass``, joined with ``+``; ``not used`` under a backend other than inductor):
    AOTAutograd saves a graph only when that cache gave keys for both the forward and the
    backward graph, so a ``miss`` left unsaved most often comes with a ``bypass`` there, and
    ``fx_graph_cache_bypass`` lists the reasons inductor logged for it (each once, shortened;
    absent when it gave none).
    """

    def __init__(self) -> None:
        self._autograd_before: dict[str, int] | None = None
        self._fx_graph_before: dict[str, int] = {}
        self._bypass_start = 0
        self.autograd_cache: str | None = None
        self.fx_graph_cache: str | None = None
        self.fx_graph_cache_bypass: list[str] = []

    def start(self) -> None:
        """Read the counters and start collecting bypass reasons."""
        self._autograd_before = _autograd_cache_counts()
        self._fx_graph_before = _fx_graph_cache_counts()
        self._bypass_start = _BYPASS_REASONS.open()

    def end(self) -> None:
        """Settle the outcomes since :meth:`start` (once; nothing before a start)."""
        if self._autograd_before is None or self.autograd_cache is not None:
            return
        self.autograd_cache = _outcomes(self._autograd_before, _autograd_cache_counts())
        self.fx_graph_cache = _outcomes(self._fx_graph_before, _fx_graph_cache_counts())
        self.fx_graph_cache_bypass = _BYPASS_REASONS.close(self._bypass_start)

    def report(self) -> dict[str, Any]:
        """The settled outcomes (``None`` before :meth:`end`), JSON-ready."""
        info: dict[str, Any] = {
            "autograd_cache": self.autograd_cache,
            "fx_graph_cache": self.fx_graph_cache,
        }
        if self.fx_graph_cache_bypass:
            info["fx_graph_cache_bypass"] = self.fx_graph_cache_bypass
        return info
