"""Sequence alignment shared by npu-compare (op streams of two dumps) and npu-profile diff."""

from __future__ import annotations

# Beyond this many edits the two sequences come from different programs: alignment is skipped.
MAX_EDIT_DISTANCE = 4000


def myers_alignment(a: list, b: list, max_distance: int = MAX_EDIT_DISTANCE) -> list[tuple[int, int]] | None:
    """Index pairs (i, j) with a[i] == b[j] of a shortest edit script, or None if D > max_distance."""
    n, m = len(a), len(b)
    limit = min(max_distance, n + m)
    offset = limit + 1
    v = [0] * (2 * limit + 3)
    trace: list[list[int]] = []
    for d in range(limit + 1):
        trace.append(v[offset - d - 1: offset + d + 2])
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]
            else:
                x = v[offset + k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            v[offset + k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m, d)
    return None


def _backtrack(trace: list[list[int]], n: int, m: int, distance: int) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    x, y = n, m
    for d in range(distance, 0, -1):
        snapshot = trace[d]  # v before round d, covering k in [-d-1, d+1]

        def value(k: int, snapshot=snapshot, d=d) -> int:
            return snapshot[k + d + 1]

        k = x - y
        if k == -d or (k != d and value(k - 1) < value(k + 1)):
            prev_k = k + 1
        else:
            prev_k = k - 1
        prev_x = value(prev_k)
        prev_y = prev_x - prev_k
        while x > prev_x and y > prev_y:
            x -= 1
            y -= 1
            pairs.append((x, y))
        x, y = prev_x, prev_y
    while x > 0 and y > 0:
        x -= 1
        y -= 1
        pairs.append((x, y))
    pairs.reverse()
    return pairs
