"""The tests' recorded times (tests/durations.json, a test's node id -> seconds), what the suite's two parts are
balanced by (tests/conftest.py, suite_part), as pytest-split keeps its .test_durations. `make test-durations` (this
module run on the junit files of the last run) brings it up to date."""

from __future__ import annotations

import functools
import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE = os.path.join(ROOT, "tests", "durations.json")
SHORTEST = 0.15  # a test faster than this is not written down (the default stands for it)


@functools.cache
def recorded() -> dict[str, float]:
    try:
        with open(FILE) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))}


def node_id(classname: str, name: str) -> str:
    """A junit testcase's pytest node id: its classname is the module's dotted path, then any classes."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return "::".join([path, *parts[i:], name])
    return f"{classname.replace('.', '/')}.py::{name}"


def main(xml_files: list[str]) -> int:
    times = dict(recorded())
    for path in xml_files:
        for case in ET.parse(path).iter("testcase"):
            if case.find("skipped") is not None:
                continue
            key, seconds = node_id(case.get("classname", ""), case.get("name", "")), float(case.get("time") or 0)
            if seconds >= SHORTEST:
                times[key] = round(seconds, 2)
            else:
                times.pop(key, None)
    with open(FILE, "w") as f:
        json.dump(dict(sorted(times.items())), f, indent=0)
        f.write("\n")
    print(f"{FILE}: {len(times)} tests of {SHORTEST} s or more, {sum(times.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
