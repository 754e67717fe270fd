"""hivemind's all-reduce load balancing without scipy (``hivemind.averaging.load_balancing``).

hivemind splits the averaged vector between the peers of a group by solving a small linear program
with ``scipy.optimize.linprog``; importing ``scipy.optimize`` costs a worker about 36 MiB that the
bare torch loop does not pay (``bench/overhead.py``). The program has a closed-form solution, so
``register()`` puts this module in hivemind's place before hivemind is imported (the engine
package does it). hivemind calls only ``load_balance_peers`` (its averagers); it gives hivemind's
results where the program has one solution, and where it has many (a slow peer bounds the round
whatever the split) an optimal one as well. ``hagenbach_bishoff`` is hivemind's, copied: importing
hivemind's module would import scipy.

The program (hivemind's docstring): peer i with bandwidth b_i and fraction w_i of the vector sends
and receives ``1 + (n - 2) * w_i`` vectors, so the round takes ``max_i (1 + (n - 2) w_i) / b_i``;
minimize it over w_i >= 0 with sum 1, peers of bandwidth 0 (client mode) getting nothing. For n > 2
the fastest peers take parts so that their times are equal (water filling): with the k fastest
taking parts, t = (n - 2 + k) / (b_1 + ... + b_k), w_i = (t b_i - 1) / (n - 2), and k is the largest
for which every w_i > 0. For n = 2 every split takes the same time (each peer sends and receives one
vector); the peers share equally, as hivemind's solver does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

LOAD_BALANCING_LP_DECIMALS = 9


def register() -> None:
    """Serve ``hivemind.averaging.load_balancing`` from this module (before hivemind is imported;
    a no-op once hivemind's own is loaded)."""
    sys.modules.setdefault("hivemind.averaging.load_balancing", sys.modules[__name__])


def load_balance_peers(vector_size: int, bandwidths: Sequence[float | None], min_size: int = 0) -> tuple[int, ...]:
    """Part sizes for each peer (hivemind's signature): ``None`` is the mean of the given bandwidths,
    0 a client-only peer; peers whose part would be under ``min_size`` elements get none."""
    given = [b for b in bandwidths if b is not None and b > 0]
    if given:
        mean = sum(given) / len(given)
        scores = optimize_parts(vector_size, [mean if b is None else float(b) for b in bandwidths], min_size)
    else:
        if all(b == 0 for b in bandwidths):
            raise ValueError("Must have at least one nonzero bandwidth")
        scores = [1.0 if b is None else 0.0 for b in bandwidths]
    return tuple(hagenbach_bishoff(vector_size, scores))


def optimize_parts(vector_size: int, bandwidths: Sequence[float], min_size: int = 0) -> list[float]:
    """Fractions of the vector that minimize the round's time (see the module's docstring)."""
    if any(b < 0 for b in bandwidths) or not any(b > 0 for b in bandwidths):
        raise ValueError(f"bandwidths must be non-negative and not all zero, got {list(bandwidths)}")
    n = len(bandwidths)
    order = sorted((i for i in range(n) if bandwidths[i] > 0), key=lambda i: -bandwidths[i])
    scores = [0.0] * n
    if n <= 2:
        for i in order:
            scores[i] = 1.0 / len(order)
    else:
        active, total = 0, 0.0
        for k, i in enumerate(order, start=1):
            level = (n - 2 + k) / (total + bandwidths[i])
            if level * bandwidths[i] <= 1.0:
                break  # this peer (and every slower one) would get a part of 0 or less
            active, total = k, total + bandwidths[i]
        level = (n - 2 + active) / total
        for i in order[:active]:
            scores[i] = (level * bandwidths[i] - 1.0) / (n - 2)
    smallest = min_size / float(vector_size) if vector_size else 0.0
    if max(scores) >= smallest:
        scores = [0.0 if s < smallest else s for s in scores]
    return [round(s, LOAD_BALANCING_LP_DECIMALS) for s in scores]


def hagenbach_bishoff(vector_size: int, scores: Sequence[float]) -> list[int]:
    """Integer parts proportional to ``scores`` (hivemind's, unchanged: largest quotients first)."""
    total_score = sum(scores)
    allocated = [int(vector_size * score / total_score) for score in scores]
    while sum(allocated) < vector_size:
        quotients = [score / (allocated[idx] + 1) for idx, score in enumerate(scores)]
        idx_max = quotients.index(max(quotients))
        allocated[idx_max] += 1
    return allocated
