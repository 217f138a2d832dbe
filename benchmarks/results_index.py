"""Write benchmarks/results/README.md: one line per kept result folder (its date, name, the report it holds and the
first line of that report: what ran, where, against what). Run after adding or removing a folder:
`python -m benchmarks.results_index`. Only folders that the README or docs/ cite are kept in the repository; a
benchmark's per-request records of each round stay out of it (.gitignore): its comparison.json keeps their figures."""

from __future__ import annotations

import argparse
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def first_line(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.strip().lstrip("# ")[:160]
    return ""


def index() -> str:
    rows = ["# Benchmark results", "",
            "Each folder is one run of a benchmark (`python -m benchmarks.NAME --out benchmarks/results/DATE-NAME`); "
            "the docs cite them by name. Regenerate this list with `python -m benchmarks.results_index`.", "",
            "| folder | report | what ran |", "| --- | --- | --- |"]
    for name in sorted(os.listdir(RESULTS)):
        folder = os.path.join(RESULTS, name)
        if not os.path.isdir(folder):
            continue
        reports = sorted(f for f in os.listdir(folder) if f.endswith(".md"))
        what = first_line(os.path.join(folder, reports[0])).replace("|", "/") if reports else ""
        report = f"[{reports[0]}]({name}/{reports[0]})" if reports else "–"
        rows.append(f"| `{name}` | {report} | {what} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    argparse.ArgumentParser(description="Write benchmarks/results/README.md: one line per result folder.").parse_args()
    with open(os.path.join(RESULTS, "README.md"), "w", encoding="utf-8") as f:
        f.write(index())
    print(f"wrote {os.path.join(RESULTS, 'README.md')}")


if __name__ == "__main__":
    main()
