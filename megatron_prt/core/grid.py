"""The rank x step grid that every plan error shows (text only, no timing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .actions import Action


def format_grid(
    ranks: Sequence[Sequence[Action]],
    marks: Mapping[int, int] | None = None,
    center: int | None = None,
    radius: int = 5,
) -> str:
    """Render steps ``center +- radius`` of every rank; ``marks[rank] = step`` is bracketed.

    With no ``center`` the window is centred on the first marked step (or the start).
    """
    marks = dict(marks or {})
    if center is None:
        center = min(marks.values()) if marks else 0
    lo = max(0, center - radius)
    hi = max(lo + 1, center + radius + 1)
    width = max([len(str(a)) for acts in ranks for a in acts[lo:hi]] + [3]) + 2
    head = "rank | " + "".join(f"{step:<{width}}" for step in range(lo, hi))
    lines = [head.rstrip(), "-" * len(head.rstrip())]
    for rank, acts in enumerate(ranks):
        cells = []
        for step in range(lo, hi):
            text = str(acts[step]) if step < len(acts) else "."
            cells.append(f"[{text}]" if marks.get(rank) == step else f" {text} ")
        lines.append(f"{rank:>4} | " + "".join(f"{c:<{width}}" for c in cells).rstrip())
    if lo > 0 or any(len(acts) > hi for acts in ranks):
        lines.append(f"(steps {lo}..{hi - 1} shown; [x] marks where each rank stands)")
    return "\n".join(lines)
