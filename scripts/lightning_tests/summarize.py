"""Counts and failures of a ``run.sh`` log (``pytest -v``: one line per finished test, with or without xdist).

usage: python summarize.py LOG [--failed-out FILE] [--oracle ORACLE_LOG]

``--failed-out`` writes the ids that did not pass (one a line); ``--oracle`` reads the log of those ids re-run
under the default strategy (``ROUNDPIPE_LT_OFF=1``) and splits the failures into those that fail there too
(the environment or Lightning: a missing package such as tensorboard, not RoundPipe's) and those that fail
under RoundPipe only (each a documented difference, a harness artefact or a bug: see README.md).
"""

from __future__ import annotations

import argparse
import collections
import re

_WORDS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_RESULT = re.compile(rf"^\[gw\d+\]\s+\[\s*\d+%\]\s+({_WORDS})\s+(.+?)\s*$|^(\S.*?::.+?)\s+({_WORDS})(?:\s+\[\s*\d+%\])?\s*$")
_NOT_PASSED = ("FAILED", "ERROR", "PASSED+ERROR", "FAILED+ERROR", "XPASS")


def read(path: str) -> tuple[dict[str, str], dict[str, str]]:
    """``({test id: outcome}, {test id: the one-line reason of a failure})`` from a log."""
    outcome: dict[str, str] = {}
    reasons: dict[str, str] = {}
    with open(path, errors="replace") as log:
        for line in log:
            match = _RESULT.match(line)
            if match:
                word, test = (match.group(1), match.group(2)) if match.group(1) else (match.group(4), match.group(3))
                if word == "ERROR" and outcome.get(test) in ("PASSED", "FAILED"):
                    word = outcome[test] + "+ERROR"  # a teardown error after the call's result
                outcome[test] = word
            elif line.startswith(("FAILED ", "ERROR ")) and " - " in line:
                test, _, reason = line.partition(" ")[2].partition(" - ")
                reasons[test.strip()] = reason.strip()
    return outcome, reasons


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--failed-out")
    parser.add_argument("--oracle")
    args = parser.parse_args()
    outcome, reasons = read(args.log)
    counts = collections.Counter(outcome.values())
    print("results: " + ", ".join(f"{counts[k]} {k.lower()}" for k in sorted(counts)) + f" ({len(outcome)} finished)")
    failed = sorted(t for t, w in outcome.items() if w in _NOT_PASSED)
    if args.failed_out:
        with open(args.failed_out, "w") as out:
            out.writelines(t + "\n" for t in failed)
    oracle = read(args.oracle)[0] if args.oracle else {}
    if oracle:
        both = [t for t in failed if oracle.get(t) not in ("PASSED", None)]
        print(f"of the {len(failed)} not passed, {len(both)} fail under the default strategy too (not RoundPipe's);"
              f" {counts['PASSED']} passed of the {counts['PASSED'] + len(failed) - len(both)} that pass under the"
              " default strategy (those that also passed here)")
    for test in failed:
        where = {None: "", "PASSED": "roundpipe only"}.get(oracle.get(test), f"default: {oracle.get(test, '').lower()}")
        print(f"{outcome[test]:13s} {where:15s} {test}  {reasons.get(test, '')[:300]}")


if __name__ == "__main__":
    main()
