#!/usr/bin/env python3
"""Student mode's blame on a real build: lesson 11 written correctly but for ONE planted bug in 11.1 (its
admission forgets to spend the token budget, so steps overflow it). The bug fails 11.1's own tests, tests
11.1 shares with 11.2, and the engine's tests (11.3 runs the scheduler): the grade must charge all of them
to 11.1, mark 11.1 failed, and 11.2 and 11.3 passed or "blocked by 11.1", never failed.

  planted_bug.py --work-dir DIR [--source REPO] [-D NAME=VALUE ...]

DIR is student.py check's --work-dir (CTest: <build>/student/shared, the workspace of the student.lessonNN
checks, so only lesson 11's files and what links them are rebuilt). Lesson 11's files are put back as the
solutions afterwards. Exit 0 when the blame is right, 1 when it is not.
"""
import argparse
import sys
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import student  # noqa: E402

LESSON, BUGGY = "11", "11.1"


def plant(ws, region):
    """Removes the last `budget -= n;` of the region's body: the admission loop's."""
    path = ws / region.path
    text = path.read_text(encoding="utf-8")
    mine = student.find_regions(ws, LESSON)[region.id]
    body = list(mine.body)
    hits = [i for i, l in enumerate(body) if l.strip() == "budget -= n;"]
    if len(hits) < 2:
        raise SystemExit(f"planted_bug.py: exercise {region.id} no longer has the two `budget -= n;` lines "
                         "this test removes the second of: update the plant")
    del body[hits[-1]]
    path.write_text(student.replace_body(text, region.path, region.id, body), encoding="utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--source", default=str(student.TOOL_SOURCE))
    ap.add_argument("-D", dest="define", action="append", default=[])
    ap.add_argument("--jobs", "-j", type=int)
    args = ap.parse_args()
    source = Path(args.source).resolve()
    ws = Path(args.work_dir).resolve() / "workspace"
    regions = student.find_regions(source, LESSON)
    files = sorted({r.path for r in regions.values()})
    if not (ws / student.STATE_FILE).exists():
        student.make_workspace(source, student.lessons_of(source)[-1], ws, stubbed=set())
    try:
        for rel in files:  # every region written (the solutions) ...
            student.copy_lesson_file(source, ws, rel, LESSON, set())
        plant(ws, regions[BUGGY])  # ... but for one bug
        record, _ = student.grade_workspace(ws, LESSON, source, ws / student.DEFAULT_BUILD, args.jobs,
                                           "planted-bug-in-" + BUGGY, [f"-D{d}" for d in args.define])
        student.print_grade(record)
    finally:
        for rel in files:
            student.copy_lesson_file(source, ws, rel, LESSON, set())
    verdicts = {e["id"]: e["verdict"] for e in record["exercises"]}
    problems = []
    if verdicts.get(BUGGY) != "failed":
        problems.append(f"{BUGGY} holds the bug but its verdict is '{verdicts.get(BUGGY)}', not 'failed'")
    for ex, v in verdicts.items():
        if ex != BUGGY and v not in ("passed", "incomplete", f"blocked by {BUGGY}"):
            problems.append(f"{ex} is correct but its verdict is '{v}'")
    if not any(v == f"blocked by {BUGGY}" for v in verdicts.values()):
        problems.append(f"no exercise is 'blocked by {BUGGY}': the plant no longer reaches a shared test, "
                        "so this checks nothing about blame")
    for p in problems:
        print(f"BLAME DEFECT: {p}")
    print("FAIL: the planted bug is blamed wrongly" if problems else
          f"PASS: the planted bug is charged to {BUGGY} alone")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
