"""Counts and failures of a run.sh log: one line per finished test (``pytest -v``, with or without xdist)."""

from __future__ import annotations

import collections
import re
import sys

_RESULT = re.compile(r"(?:\[gw\d+\]\s+\[\s*\d+%\]\s+)?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)"
                     r"|^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def main(path: str) -> None:
    outcome: dict[str, str] = {}
    reasons: dict[str, str] = {}
    with open(path, errors="replace") as log:
        for line in log:
            match = _RESULT.search(line)
            if match:
                word, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
                if word == "ERROR" and outcome.get(test) in ("PASSED", "FAILED"):
                    word = outcome[test] + "+ERROR"  # a teardown error after the call's result
                outcome[test] = word
            elif line.startswith(("FAILED ", "ERROR ")) and " - " in line:
                test, _, reason = line.partition(" ")[2].partition(" - ")
                reasons[test.strip()] = reason.strip()
    counts = collections.Counter(outcome.values())
    print("results: " + ", ".join(f"{counts[k]} {k.lower()}" for k in sorted(counts)) + f" ({len(outcome)} finished)")
    for test, word in sorted(outcome.items()):
        if word not in ("PASSED", "SKIPPED", "XFAIL"):
            print(f"{word:13s} {test}  {reasons.get(test, '')[:300]}")


if __name__ == "__main__":
    main(sys.argv[1])
