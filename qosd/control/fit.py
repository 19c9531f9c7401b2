"""Weighted least squares of a few unknowns, for the SLO loop's learners.

The models the loop learns have two or three coefficients (``qosd.control.prefill``,
``qosd.control.passes``), fitted once a turn to a few dozen points: the normal
equations, solved by elimination, are a dozen lines. numpy would do it too, but the
daemon does not otherwise depend on it, and its import alone takes longer than a
turn's fits (``docs/control.md``, "Fitting").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(vector)
    rows = [[*row, vector[i]] for i, row in enumerate(matrix)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for row in range(col + 1, n):
            factor = rows[row][col] / rows[col][col]
            for k in range(col, n + 1):
                rows[row][k] -= factor * rows[col][k]
    solution = [0.0] * n
    for row in reversed(range(n)):
        known = sum(rows[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = (rows[row][n] - known) / rows[row][row]
    return solution


def weighted_least_squares(
    points: Iterable[tuple[float, Sequence[float], float]],
) -> list[float] | None:
    """The coefficients ``c`` that minimise ``Σ w·(y - x·c)²`` over ``(w, x, y)``
    points (every ``x`` of one length); None when the points cannot tell them apart."""
    matrix: list[list[float]] = []
    vector: list[float] = []
    for weight, x, y in points:
        if not matrix:
            matrix = [[0.0] * len(x) for _ in x]
            vector = [0.0] * len(x)
        for i, xi in enumerate(x):
            vector[i] += weight * xi * y
            for j, xj in enumerate(x):
                matrix[i][j] += weight * xi * xj
    return _solve(matrix, vector) if matrix else None
