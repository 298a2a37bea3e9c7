"""Check two Megatron-LM training logs: losses fall, and a run resumed from a checkpoint
continues the losses of the run that saved it (``scripts/megatron_lm_smoke.sh``).

    python -m megatron_prt.megatron.megatron_lm_check FIRST.log RESUMED.log --resumed-at 3

Megatron-LM's ``training_log`` prints the first iteration of every run without resetting its
running sums (``should_reset = not is_first_iteration``, ``megatron/training/training.py``
at core_v0.16.1), so the second iteration a run prints is the mean of its first two. The
check compares the resumed run's first printed iteration as it is, recovers the second from
that mean (``2 * printed - first``, equal to the saving run's to the printed digits), and
compares every later one as printed.
"""

from __future__ import annotations

import argparse
import re
import sys

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_LOSS = re.compile(r" ([a-z][a-z ]*loss): ([0-9.eE+-]+) \|")
# Printed with 7 significant digits: one unit in the last place of a loss near 10 is 1e-6;
# recovering the second iteration doubles a printed value, so allow two units.
_RECOVERED_TOLERANCE = 2.5e-6


def read_losses(path: str) -> dict[int, dict[str, float]]:
    """``{iteration: {"lm loss": value, ...}}`` of the lines Megatron-LM printed to ``path``
    (``loss scale`` is not a loss)."""
    losses: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            match = _ITERATION.search(line)
            if match is None:
                continue
            found = {k: float(v) for k, v in _LOSS.findall(match.group(2) + " |")}
            found.pop("loss scale", None)
            if found:
                losses[int(match.group(1))] = found
    return losses


def check(first: str, resumed: str, resumed_at: int) -> list[str]:
    """The failures (empty: both hold), each naming the log, the iteration and the loss."""
    a, b = read_losses(first), read_losses(resumed)
    if not a:
        return [f"{first}: no iteration line with a loss"]
    failures = []
    start, end = min(a), max(a)
    for key in ("lm loss",):  # BERT's sentence-order loss is too noisy for 6 iterations
        if key in a[start] and not a[end][key] < a[start][key]:
            failures.append(
                f"{first}: {key} did not fall: {a[start][key]} at iteration {start}, "
                f"{a[end][key]} at iteration {end}"
            )
    expected = [it for it in sorted(a) if it > resumed_at]
    if sorted(b) != expected:
        return [*failures, f"{resumed}: iterations {sorted(b)}, expected {expected}"]
    for index, it in enumerate(expected):
        for key, want in a[it].items():
            got = b[it][key]
            if index == 1:  # the mean of the resumed run's first two (module docstring)
                got = 2 * got - b[expected[0]][key]
                ok = abs(got - want) <= _RECOVERED_TOLERANCE * max(1.0, abs(want))
            else:
                ok = got == want
            if not ok:
                failures.append(
                    f"{resumed}: iteration {it} {key} {got!r}, the saving run had {want!r}"
                )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", help="log of the run that saved the checkpoint")
    parser.add_argument("resumed", help="log of the run that loaded it")
    parser.add_argument("--resumed-at", type=int, required=True, help="checkpoint iteration")
    args = parser.parse_args(argv)
    for it, values in sorted(read_losses(args.first).items()):
        print(f"first   iteration {it}: {values}")
    for it, values in sorted(read_losses(args.resumed).items()):
        print(f"resumed iteration {it}: {values}")
    failures = check(args.first, args.resumed, args.resumed_at)
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    if not failures:
        print(f"ok: losses fall; resumed at {args.resumed_at}, the losses continue")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
