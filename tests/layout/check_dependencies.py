#!/usr/bin/env python3
"""Fails, naming the file and the include, when a folder uses one it may not.

The allowed dependencies are the table in tests/layout/dependencies.txt: one
line per folder, "folder: the folders it may include from". A source file of
a folder in the table may include headers of its own folder and of those
listed; a folder not in the table (tests/, bench/) may include anything.
Includes are the quoted, root-relative kind (#include "train/model.h").

Usage: check_dependencies.py ROOT [TABLE]
       check_dependencies.py --self-test   (an upward and a sideways include
                                            in a small tree are both caught)
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cpp", ".cu", ".cuh")


def read_table(path):
    allowed = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if ":" not in line:
                raise ValueError(f"{path}:{number}: expected 'folder: allowed folders', got {line!r}")
            folder, uses = line.split(":", 1)
            folder = folder.strip()
            if folder in allowed:
                raise ValueError(f"{path}:{number}: {folder} appears twice")
            allowed[folder] = set(uses.split())
    for folder, uses in allowed.items():
        for used in uses:
            if used not in allowed:
                raise ValueError(f"{path}: {folder} may use {used}, which the table does not list")
    return allowed


def check(root, allowed):
    problems = []
    checked = 0
    for folder in sorted(allowed):
        for directory, _, names in os.walk(os.path.join(root, folder)):
            for name in sorted(names):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, root)
                with open(path, errors="replace") as f:
                    text = f.read()
                checked += 1
                for match in INCLUDE.finditer(text):
                    target = match.group(1)
                    top = target.split("/", 1)[0]
                    if "/" not in target or top == folder or top not in allowed:
                        continue  # a header beside the file, its own folder, or a third-party one
                    if top not in allowed[folder]:
                        line = text.count("\n", 0, match.start()) + 1
                        problems.append(f"{relative}:{line}: includes \"{target}\": {folder}/ may not use {top}/ "
                                        f"(it may use: {', '.join(sorted(allowed[folder])) or 'nothing'})")
    return checked, problems


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        table = os.path.join(root, "table.txt")
        with open(table, "w") as f:
            f.write("base:\ntrain: base\naggregator: base train\ngossip: base train\n")
        sources = {
            "base/status.h": '#include <string>\n',
            "train/model.h": '#include "base/status.h"\n#include "train/layer.h"\n#include <vector>\n',
            "aggregator/server.cpp": '#include "train/model.h"\n#include "gossip/swim.h"\n',
            "gossip/swim.h": '#include "base/status.h"\n',
            "base/file.cpp": '#include "base/status.h"\n  #  include "train/model.h"\n',
        }
        for name, text in sources.items():
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            with open(os.path.join(root, name), "w") as f:
                f.write(text)
        checked, problems = check(root, read_table(table))
        expected = ['aggregator/server.cpp:2: includes "gossip/swim.h"', 'base/file.cpp:2: includes "train/model.h"']
        caught = all(any(problem.startswith(e) for problem in problems) for e in expected)
        if checked != 5 or len(problems) != len(expected) or not caught:
            print(f"self-test failed: checked {checked} files, found {problems}", file=sys.stderr)
            return 1
        for problem in problems:
            print(f"self-test (expected): {problem}")
    print("check_dependencies: self-test passed (an upward and a sideways include are refused)")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[1]
    table = argv[2] if len(argv) == 3 else os.path.join(root, "tests", "layout", "dependencies.txt")
    try:
        allowed = read_table(table)
    except (OSError, ValueError) as error:
        print(f"check_dependencies: {error}", file=sys.stderr)
        return 2
    checked, problems = check(root, allowed)
    for problem in problems:
        print(problem)
    print(f"check_dependencies: {checked} files in {len(allowed)} folders, {len(problems)} includes out of order")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
