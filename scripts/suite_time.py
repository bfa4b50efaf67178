"""Where the test suite's time goes, per test file, from the log of a run with ``--durations=0``.

    .venv/bin/python -m pytest -q --durations=0 > suite.log; python scripts/suite_time.py suite.log [--top 40]

Sums each file's setup, call and teardown seconds (a module-scoped fixture's cost lands on its first test's setup),
ranks the files, and ends with one summary line: the seconds of all files together and what that is per worker at
pytest-xdist's two workers (the suite's wall time is close to it when no single file is longer)."""
import argparse
import collections
import re

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+([^:\s]+)::")


def per_file(log: str) -> collections.Counter:
    seconds: collections.Counter = collections.Counter()
    for line in log.splitlines():
        match = LINE.match(line)
        if match:
            seconds[match.group(2)] += float(match.group(1))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.log) as f:
        seconds = per_file(f.read())
    for path, total in seconds.most_common(args.top):
        print(f"{total:8.1f} s  {path}")
    total = sum(seconds.values())
    print(f"{len(seconds)} files, {total:.0f} s of tests in all, {total / 2 / 60:.1f} min per worker at -n 2")


if __name__ == "__main__":
    main()
