"""Where the induction-head phase change happened in a run: the step at which the ICL score falls fastest.

Olsson et al. (2022) see in-context learning appear in a short span of training: the ICL score (late-context loss
minus early-context loss) drops sharply while induction heads form. From the ICL scores of a run's evaluations,
the fall per step is taken over each pair of evaluations two apart (centred on the evaluation between them, which
halves the effect of one noisy evaluation) or, with only two evaluations, over those two; the step of the
steepest fall is the phase change, once that fall is at least MIN_FALL nats (smaller falls are the measure's
noise or slow drift, not a phase change).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_FALL = 0.1  # nats of ICL score; its standard error over 64 windows is about 0.02-0.05 on the CPU recipes


def phase_change_step(points: Sequence[tuple[int, float]]) -> int | None:
    """The step where the ICL score falls fastest, from (step, icl_score) pairs of a run's evaluations in step
    order; None while no fall of at least MIN_FALL nats is seen."""
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    if len(points) < 2:
        return None
    if len(points) == 2:
        (a, va), (b, vb) = points
        spans = [(a, va, b, vb, (a + b) // 2)]
    else:
        spans = [(a, va, b, vb, points[i + 1][0]) for i, ((a, va), (b, vb)) in enumerate(zip(points, points[2:]))]
    best = min(spans, key=lambda span: (span[3] - span[1]) / max(span[2] - span[0], 1))
    _, start, _, end, step = best
    return step if start - end >= MIN_FALL else None
