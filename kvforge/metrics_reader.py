"""Prometheus series as plain dataclasses, the shapes of vLLM's offline reader (``vllm.v1.metrics.reader``).

``LLM.get_metrics()`` returns one of these per series: a ``Counter`` (its value an int), a ``Gauge`` (a float),
a ``Histogram`` (its count, sum and cumulative bucket counts keyed by upper bound as prometheus writes it,
``'+Inf'`` included) or a ``Vector``: a counter family labelled ``position`` (the speculative per-position
acceptance) as one list of ints indexed by position, per set of its other labels. A name is the family's
(``kvforge:...``; a counter's without ``_total``).

    for m in llm.get_metrics():
        if isinstance(m, Counter):
            print(m.name, m.labels, m.value)
"""

from __future__ import annotations

from dataclasses import dataclass

#: The label that turns a counter family into a ``Vector``: its samples are the vector's entries.
POSITION_LABEL = "position"


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str]


@dataclass(frozen=True)
class Counter(Metric):
    value: int


@dataclass(frozen=True)
class Gauge(Metric):
    value: float


@dataclass(frozen=True)
class Vector(Metric):
    values: list[int]


@dataclass(frozen=True)
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def read_registry(registry) -> list[Metric]:
    """Every series of a ``prometheus_client`` registry as of now (``registry.collect()``), in its order,
    converted as the module docstring says. A family of another type (summary, info, ...) raises ValueError."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "gauge":
            metrics += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "counter":
            samples = [s for s in family.samples if s.name == family.name + "_total"]
            if any(POSITION_LABEL in s.labels for s in samples):
                metrics += _vectors(family.name, samples)
            else:
                metrics += [Counter(family.name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "histogram":
            metrics += _histograms(family)
        else:
            raise ValueError(f"{family.name}: a {family.type} has no reader class (counter, gauge, histogram)")
    return metrics


def _without(labels: dict, name: str) -> dict[str, str]:
    return {k: v for k, v in labels.items() if k != name}


def _vectors(name: str, samples) -> list[Vector]:
    """One Vector per label set besides the position; a position without a sample counts 0."""
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        key = tuple(_without(s.labels, POSITION_LABEL).items())
        by_labels.setdefault(key, {})[int(s.labels[POSITION_LABEL])] = int(s.value)
    return [Vector(name, dict(key), [counts.get(pos, 0) for pos in range(max(counts) + 1)])
            for key, counts in by_labels.items()]


def _histograms(family) -> list[Histogram]:
    """One Histogram per label set, from its ``_bucket`` (by ``le``), ``_count`` and ``_sum`` samples."""
    parts: dict[tuple, dict] = {}
    for s in family.samples:
        suffix = s.name[len(family.name):]
        if suffix not in ("_bucket", "_count", "_sum"):
            continue  # _created
        key = tuple(_without(s.labels, "le").items())
        part = parts.setdefault(key, {"count": 0, "sum": 0.0, "buckets": {}})
        if suffix == "_bucket":
            part["buckets"][s.labels["le"]] = int(s.value)
        elif suffix == "_count":
            part["count"] = int(s.value)
        else:
            part["sum"] = float(s.value)
    return [Histogram(family.name, dict(key), **part) for key, part in parts.items()]
