#!/usr/bin/env python3
"""tiny-vllm student mode: hand out a lesson with its exercises stubbed, move on, reveal, grade, check.

  student.py start  --lesson 04 --out ~/tvllm-04        a workspace: lessons < 04 solved, 04 stubbed, none later
  student.py next   --workspace ~/tvllm-04              add lesson 05 (stubbed), keeping every file you edited
  student.py reveal --workspace ~/tvllm-04 --exercise 04.2    put one exercise's solution in (recorded)
  student.py grade  --workspace ~/tvllm-04 [--json g.json]    build what the lesson's tests need, run them
                                                        (g.json, and g.csv beside it: the gradebook row)
  student.py grade-all --submissions DIR --lesson 04 --json gradebook.json   a class, one workspace per folder
                                                        (gradebook.json, and gradebook.csv: a row a student)
  student.py check  --lesson 04 [--quick] [--strict]   course authors / CI: every exercise's tests fail on its
                                                        stub and pass on its solution (--quick: CI's two-phase
                                                        form; --strict: skipped GPU tests make it exit 3)
  student.py list   [--lesson 04]                       the marked regions of the repository

Exit status of grade, grade-all and check: 0 every exercise passed and nothing was skipped; 1 something failed
(a test, the build, or for check a test that passes on its stub); 2 bad usage or a malformed workspace/marker;
3 nothing failed but GPU tests were skipped (no GPU here): the grade is incomplete, NOT a pass.

A region, in a lesson's C++/CUDA source (lessons/INSTRUCTORS.md, "Marking a region", says more):

  // --- exercise 04.1: the naive kernel ---------------------------------------------------
  // Task: what to write, in a sentence or three (continuation lines start with "//" and 2+ spaces).
  // Hint: one hint per line; as many as you like.
  // Tests: Rmsnorm.MatchesCpuOnRandomInputs RmsnormGpu.* lesson04_rmsnorm.gpu
  // Needs: 04.1        (optional: exercises its tests also run; a failure is charged to them first)
  // Stub:
  //   TVLLM_DEVICE_NOT_WRITTEN_YET("04.1", "the naive kernel");
  // --- solution ---
  ...the solution code (the default build compiles it)...
  // --- end of exercise 04.1 ---

A failing test is charged to the earliest exercise that explains it (a stub it printed, an exercise that
lists or is needed by it and fails already); an exercise whose failures are all charged elsewhere is
"blocked by" those (assign_blame).

Tests are CTest test names or glob patterns over them (GoogleTest cases are named Suite.Name; lesson
executables lessonNN_name.cpu / .gpu); whether a test needs a GPU comes from its CTest label. Without a Stub:
field the stub is `throw ::tvllm::NotWrittenYet("04.1", "title");` (common/exercise.h); `Stub: device` gives
`TVLLM_DEVICE_NOT_WRITTEN_YET("04.1", "title");` for a kernel body.

Python 3.8+, standard library only.
"""
import argparse
import csv
import datetime
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3
STATE_FILE = ".student.json"
DEFAULT_BUILD = "build-student"
SOURCE_SUFFIXES = {".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu"}
TOOL_SOURCE = Path(__file__).resolve().parents[2]  # the repository this script belongs to

BEGIN_RE = re.compile(r"^(\s*)// --- exercise (\d\d)\.(\d+): (.+?)\s*-*\s*$")
BODY_RE = re.compile(r"^\s*// --- (solution|your code)\b.*$")
END_RE = re.compile(r"^\s*// --- end of exercise (\d\d\.\d+) ---\s*$")
FIELD_RE = re.compile(r"^\s*// (Task|Hint|Tests|Needs|Stub):(.*)$")
EXERCISE_ID_RE = re.compile(r"^\d\d\.\d+$")
COMMENT_RE = re.compile(r"^\s*//(.*)$")
LESSON_PATH_RE = re.compile(r"^(?:lessons/(\d\d)_[^/]+/|tests/test_(\d\d)_[^/]*$)")


class UsageError(Exception):
    """Bad usage, a malformed marker or workspace: exit 2 with the message."""


def note(msg):
    print(msg, flush=True)


# ---- regions --------------------------------------------------------------------------------------------


class Region:
    def __init__(self, path, exercise, title, indent):
        self.path = path            # relative to the tree, posix
        self.id = exercise          # "01.3"
        self.lesson = exercise[:2]
        self.title = title
        self.indent = indent
        self.task, self.hints, self.tests = [], [], []
        self.needs = []             # exercises this region's tests also run ("Needs:"): blamed first
        self.stub = None            # list of code lines (indent stripped), or None: the default
        self.stub_kind = "host"
        self.header = []            # the marker lines from BEGIN up to (not including) the body marker
        self.body = []              # the code between the body marker and END
        self.begin = self.body_line = self.end = 0  # 0-based line numbers

    def stub_lines(self):
        if self.stub is not None:
            return [self.indent + s if s else "" for s in self.stub]
        if self.stub_kind == "device":
            return [f'{self.indent}TVLLM_DEVICE_NOT_WRITTEN_YET("{self.id}", "{self.title}");']
        return [f'{self.indent}throw ::tvllm::NotWrittenYet("{self.id}", "{self.title}");']

    def header_without_stub(self):
        """The marker lines a student sees: the task, hints and tests, not the Stub: block."""
        out, in_stub = [], False
        for line in self.header:
            m = FIELD_RE.match(line)
            if m:
                in_stub = m.group(1) == "Stub"
            if not in_stub:
                out.append(line)
        return out


def _norm(lines):
    return [l.strip() for l in lines if l.strip()]


def parse_regions(text, path):
    """Every region of one file. Raises UsageError (file:line: problem) for a malformed marker."""
    lines = text.split("\n")
    regions, i = [], 0
    while i < len(lines):
        m = BEGIN_RE.match(lines[i])
        if not m:
            if END_RE.match(lines[i]) or BODY_RE.match(lines[i]):
                raise UsageError(f"{path}:{i + 1}: '{lines[i].strip()}' outside an exercise region")
            i += 1
            continue
        r = Region(path, f"{m.group(2)}.{m.group(3)}", m.group(4).strip(), m.group(1))
        r.begin = i
        field, j = None, i + 1
        while True:
            if j >= len(lines):
                raise UsageError(f"{path}:{i + 1}: exercise {r.id} has no '// --- solution ---' line")
            line = lines[j]
            if BODY_RE.match(line):
                break
            if BEGIN_RE.match(line) or END_RE.match(line):
                raise UsageError(f"{path}:{j + 1}: exercise {r.id}: expected '// --- solution ---' first")
            fm = FIELD_RE.match(line)
            cm = COMMENT_RE.match(line)
            if fm:
                field, rest = fm.group(1), fm.group(2).strip()
                if field == "Task":
                    r.task.append(rest)
                elif field == "Hint":
                    r.hints.append(rest)
                elif field == "Tests":
                    r.tests += [t for t in re.split(r"[\s,]+", rest) if t]
                elif field == "Needs":
                    for n in [t for t in re.split(r"[\s,]+", rest) if t]:
                        if not EXERCISE_ID_RE.match(n) or n == r.id:
                            raise UsageError(f"{path}:{j + 1}: exercise {r.id}: 'Needs:' takes other exercise "
                                             f"ids (NN.K), got '{n}'")
                        r.needs.append(n)
                elif field == "Stub":
                    if rest == "device":
                        r.stub_kind = "device"
                    elif rest:
                        raise UsageError(f"{path}:{j + 1}: 'Stub:' takes the code on the lines below it, or 'device'")
                    else:
                        r.stub = []
            elif cm and field is not None:
                body = cm.group(1)
                if field == "Stub" and r.stub is not None:
                    r.stub.append(body)
                elif body.startswith("  ") and field in ("Task", "Hint"):
                    (r.task if field == "Task" else r.hints)[-1] += " " + body.strip()
                elif body.startswith("  ") and field == "Tests":
                    r.tests += [t for t in re.split(r"[\s,]+", body) if t]
                elif body.strip():
                    raise UsageError(f"{path}:{j + 1}: exercise {r.id}: a marker line must start with Task:, "
                                     "Hint:, Tests:, Needs: or Stub: (continuations with '//' and two spaces)")
            elif line.strip():
                raise UsageError(f"{path}:{j + 1}: exercise {r.id}: code before '// --- solution ---'")
            r.header.append(line)
            j += 1
        r.body_line = j
        k = j + 1
        while True:
            if k >= len(lines):
                raise UsageError(f"{path}:{i + 1}: exercise {r.id} has no '// --- end of exercise {r.id} ---'")
            em = END_RE.match(lines[k])
            if em:
                if em.group(1) != r.id:
                    raise UsageError(f"{path}:{k + 1}: end of exercise {em.group(1)} inside exercise {r.id}")
                break
            if BEGIN_RE.match(lines[k]):
                raise UsageError(f"{path}:{k + 1}: a region inside exercise {r.id} (regions do not nest)")
            k += 1
        r.body, r.end = lines[j + 1:k], k
        if r.stub is not None:  # dedent the stub block by its common indentation
            pad = min((len(s) - len(s.lstrip()) for s in r.stub if s.strip()), default=0)
            r.stub = [s[pad:].rstrip() for s in r.stub]
            while r.stub and not r.stub[-1]:
                r.stub.pop()
            if not r.stub:
                raise UsageError(f"{path}:{i + 1}: exercise {r.id}: 'Stub:' with no code below it")
        if not r.tests:
            raise UsageError(f"{path}:{i + 1}: exercise {r.id} names no tests (a 'Tests:' line)")
        if not r.task:
            raise UsageError(f"{path}:{i + 1}: exercise {r.id} has no 'Task:'")
        regions.append(r)
        i = k + 1
    return regions


def tree_files(root):
    """Files of a tree that may hold regions (lessons/**), relative posix paths."""
    out = []
    for p in sorted((root / "lessons").rglob("*")):
        if p.is_file() and p.suffix in SOURCE_SUFFIXES:
            out.append(p.relative_to(root).as_posix())
    return out


def find_regions(root, lesson=None):
    """{exercise id: Region} of a tree (a repository or a workspace), in id order."""
    found = {}
    for rel in tree_files(root):
        m = LESSON_PATH_RE.match(rel)
        if lesson is not None and (not m or m.group(1) != lesson):
            continue
        text = (root / rel).read_text(encoding="utf-8")
        if "// --- exercise " not in text:
            continue
        for r in parse_regions(text, rel):
            if r.lesson != (m.group(1) if m else None):
                raise UsageError(f"{rel}:{r.begin + 1}: exercise {r.id} is in the folder of lesson "
                                 f"{m.group(1) if m else '?'}")
            if r.id in found:
                raise UsageError(f"{rel}:{r.begin + 1}: exercise {r.id} is also marked in {found[r.id].path}")
            found[r.id] = r
    return dict(sorted(found.items(), key=lambda kv: (kv[0][:2], int(kv[0][3:]))))


def render(text, path, stubbed, body_marker=None):
    """The file with the regions whose id is in `stubbed` replaced by their stub (marker kept, Stub: block
    dropped from the student's copy). Other regions keep their code."""
    regions = parse_regions(text, path)
    lines = text.split("\n")
    for r in reversed(regions):
        if r.id not in stubbed:
            continue
        new = r.header_without_stub()
        new.append(f"{r.indent}// --- your code (replace the stub; keep this line and the end line) ---")
        new += r.stub_lines()
        lines[r.begin + 1:r.end] = new
    return "\n".join(lines)


def replace_body(text, path, exercise, new_body):
    regions = {r.id: r for r in parse_regions(text, path)}
    if exercise not in regions:
        raise UsageError(f"{path}: the markers of exercise {exercise} are gone; put back the lines "
                         f"'// --- your code ...' and '// --- end of exercise {exercise} ---'")
    r = regions[exercise]
    lines = text.split("\n")
    lines[r.body_line + 1:r.end] = new_body
    return "\n".join(lines)


# ---- trees, workspaces, state ---------------------------------------------------------------------------


def git_files(source):
    """The repository's files: tracked, plus untracked ones git does not ignore (work not yet committed)."""
    try:
        out = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        return sorted({f for f in out.decode().split("\0") if f and (source / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        pass
    # Not a git checkout (a copied tree): every file but build outputs and what .gitignore names.
    skip = re.compile(r"^(build[^/]*|\.git|\.deps|\.whl|weights/random-[^/]*|weights/Llama-[^/]*|tests/fuzz/corpus-run)(/|$)"
                      r"|(^|/)__pycache__/|\.pyc$|(^|/)(crash|leak|timeout)-[^/]*$")
    files = []
    for p in source.rglob("*"):
        rel = p.relative_to(source).as_posix()
        if p.is_file() and not skip.search(rel) and not rel.startswith(STATE_FILE):
            files.append(rel)
    return sorted(files)


def git_commit(source):
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def file_lesson(rel):
    m = LESSON_PATH_RE.match(rel)
    return (m.group(1) or m.group(2)) if m else None


def lessons_of(source):
    return sorted({file_lesson(f) for f in git_files(source)} - {None})


def write_if_changed(path, text):
    """Writes only when the content differs, so the build's timestamps stay put for unchanged files."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


def copy_lesson_file(source, ws, rel, stub_lesson, stubbed=None):
    """Copies one file; a source file of the stubbed lesson gets its regions stubbed."""
    src, dst = source / rel, ws / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    if Path(rel).suffix in SOURCE_SUFFIXES and file_lesson(rel) == stub_lesson:
        text = src.read_text(encoding="utf-8")
        if "// --- exercise " in text:
            ids = {r.id for r in parse_regions(text, rel)} if stubbed is None else stubbed
            write_if_changed(dst, render(text, rel, ids))
            return
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        shutil.copy2(src, dst)


def load_state(ws):
    p = ws / STATE_FILE
    if not p.exists():
        raise UsageError(f"{ws}: not a student workspace (no {STATE_FILE}; make one with `student.py start`)")
    return json.loads(p.read_text())


def save_state(ws, state):
    (ws / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def source_of(args, state=None):
    s = getattr(args, "source", None) or (state or {}).get("source") or str(TOOL_SOURCE)
    p = Path(s).resolve()
    if not (p / "lessons").is_dir():
        raise UsageError(f"{p}: not a tiny-vllm repository (pass --source)")
    return p


def make_workspace(source, lesson, out, stubbed=None):
    lessons = lessons_of(source)
    if lesson not in lessons:
        raise UsageError(f"no lesson {lesson} in {source} (lessons: {' '.join(lessons)})")
    out.mkdir(parents=True, exist_ok=True)
    for rel in git_files(source):
        fl = file_lesson(rel)
        if fl is not None and fl > lesson:
            continue
        copy_lesson_file(source, out, rel, lesson, stubbed)
    if not (out / STATE_FILE).exists():  # marks the tree as a workspace (tests/student/CMakeLists.txt)
        save_state(out, {"version": 1, "lesson": lesson, "source": str(source), "revealed": {}})
    return lessons


def cmd_start(args):
    source = source_of(args)
    lesson = f"{int(args.lesson):02d}"
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty")
    make_workspace(source, lesson, out)
    regions = find_regions(source, lesson)
    save_state(out, {"version": 1, "lesson": lesson, "source": str(source), "source_commit": git_commit(source),
                     "started": {lesson: now()}, "revealed": {}})
    note(f"student workspace for lesson {lesson}: {out}")
    note(f"  lessons before {lesson} are solved; lesson {lesson} has {len(regions)} exercise(s) to write:")
    for r in regions.values():
        note(f"    {r.id}  {r.title:<40} {r.path}")
    note(f"  grade it: python3 tests/student/student.py grade --workspace {out}")
    return EXIT_PASS


def cmd_next(args):
    ws = Path(args.workspace).resolve()
    state = load_state(ws)
    source = source_of(args, state)
    cur = state["lesson"]
    later = [l for l in lessons_of(source) if l > cur]
    if not later:
        note(f"lesson {cur} is the last lesson in {source}: nothing to add")
        return EXIT_PASS
    nxt = later[0]
    ref = find_regions(source, cur)
    unwritten = [r.id for r in find_regions(ws, cur).values()
                 if r.id in ref and _norm(r.body) == _norm(ref[r.id].stub_lines())]
    kept = []
    for rel in git_files(source):
        if file_lesson(rel) != nxt:
            continue
        if (ws / rel).exists():
            kept.append(rel)
            continue
        copy_lesson_file(source, ws, rel, nxt)
    state["lesson"] = nxt
    state.setdefault("started", {})[nxt] = now()
    save_state(ws, state)
    note(f"moved on to lesson {nxt}: its files and tests are in {ws}, stubbed; your lesson {cur} code is kept")
    for rel in kept:
        note(f"  kept your {rel} (it was already in the workspace)")
    for r in find_regions(ws, nxt).values():
        note(f"    {r.id}  {r.title:<40} {r.path}")
    if unwritten:
        note(f"  note: lesson {cur} exercises {', '.join(unwritten)} are still stubs; lesson {nxt} builds on "
             f"them. Finish them, or `student.py reveal --exercise ID` each.")
    return EXIT_PASS


def cmd_reveal(args):
    ws = Path(args.workspace).resolve()
    state = load_state(ws)
    source = source_of(args, state)
    ex = args.exercise
    sol = find_regions(source, ex[:2]).get(ex)
    if sol is None:
        raise UsageError(f"no exercise {ex} in {source}")
    target = ws / sol.path
    if not target.exists():
        raise UsageError(f"{target} is not in the workspace (lesson {ex[:2]} not started yet?)")
    text = target.read_text(encoding="utf-8")
    write_if_changed(target, replace_body(text, sol.path, ex, sol.body))
    state.setdefault("revealed", {})[ex] = now()
    save_state(ws, state)
    note(f"revealed exercise {ex} ({sol.title}) in {sol.path}; the grade will say so")
    return EXIT_PASS


def cmd_list(args):
    source = source_of(args)
    lesson = f"{int(args.lesson):02d}" if args.lesson else None
    for r in find_regions(source, lesson).values():
        needs = f"  needs: {' '.join(r.needs)}" if r.needs else ""
        note(f"{r.id}  {r.title:<44} {r.path}:{r.begin + 1}  tests: {' '.join(r.tests)}{needs}")
    return EXIT_PASS


# ---- building and running tests -------------------------------------------------------------------------


def have_gpu():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def build_env(ws):
    env = dict(os.environ)
    # Workspaces differ only in their path: with paths made relative to the workspace, ccache serves the
    # objects of unchanged files (earlier lessons, common/) from another workspace's or an earlier build.
    env["CCACHE_BASEDIR"] = str(ws)
    env["CCACHE_NOHASHDIR"] = "1"
    return env


def configure(ws, bd, extra):
    if (bd / "CMakeCache.txt").exists() and ((bd / "build.ninja").exists() or (bd / "Makefile").exists()):
        return
    cmd = ["cmake", "-S", str(ws), "-B", str(bd), "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    if shutil.which("ccache"):
        cmd += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        note(f"configuring {bd} (compiled through ccache: files another workspace built come from the cache)")
    else:
        note(f"configuring {bd}. NOTE: ccache is not installed, so this workspace compiles from scratch "
             "(lessons 00 to this one, minutes on a small machine). Install ccache (apt install ccache) to "
             "share one cache between workspaces: a class then compiles the common code once.")
    cmd += extra
    p = subprocess.run(cmd, capture_output=True, text=True, env=build_env(ws))
    (bd / "student-configure.log").parent.mkdir(parents=True, exist_ok=True)
    (bd / "student-configure.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise UsageError(f"cmake configure failed (log: {bd / 'student-configure.log'}):\n{tail(p.stdout + p.stderr)}")


def tail(text, n=25):
    return "\n".join(text.rstrip().splitlines()[-n:])


def suite_targets(ws):
    """GoogleTest suite name -> the test targets (tests/test_*.cpp stems) that define it."""
    out = {}
    pat = re.compile(r"\b(?:TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)\s*\(\s*(\w+)\s*,"
                     r"|\bINSTANTIATE_TEST_SUITE_P\s*\(\s*\w+\s*,\s*(\w+)")
    for p in sorted((ws / "tests").glob("test_*.cpp")):
        for m in pat.finditer(p.read_text(encoding="utf-8", errors="replace")):
            out.setdefault(m.group(1) or m.group(2), set()).add(p.stem)
    return out


def targets_for(ws, regions):
    """The build targets that hold the regions' tests: test executables and lesson executables."""
    suites, targets = suite_targets(ws), set()
    lesson_exes = {f"lesson{d.name[:2]}_{d.name[3:]}" for d in (ws / "lessons").glob("[0-9][0-9]_*") if d.is_dir()}
    for r in regions:
        for pat in r.tests:
            m = re.match(r"^(?:course\.)?(lesson\d\d_\w+)\.", pat)
            if m and m.group(1) in lesson_exes:
                targets.add(m.group(1))
                continue
            suite = pat.split(".")[0].split("/")[-1]
            hit = {t for s, ts in suites.items() if fnmatch.fnmatchcase(s, suite) for t in ts}
            if not hit:  # not a suite we can see: build the lesson's test executables
                hit = {p.stem for p in (ws / "tests").glob(f"test_{r.lesson}_*.cpp")}
            targets |= hit
    return sorted(targets)


PROGRESS_RE = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")         # Ninja: [12/340] Building CXX object x.o
MAKE_PROGRESS_RE = re.compile(r"^\[\s*(\d+)%\]\s*(.*)$")        # Make:  [ 45%] Building CXX object x.o


def build(ws, bd, targets, jobs=None, log=None):
    """Builds the targets, going on past errors, showing progress (Ninja's [done/total] or Make's [ n%], at
    most one line every few seconds). Returns (ok, log)."""
    log = log or note
    cmd = ["cmake", "--build", str(bd), "--target", *targets]
    if jobs:
        cmd += ["-j", str(jobs)]
    if (bd / "build.ninja").exists():
        cmd += ["--", "-k", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=build_env(ws))
    lines, last, last_shown, start = [], None, 0.0, time.monotonic()
    for line in p.stdout:
        lines.append(line)
        m = PROGRESS_RE.match(line.strip())
        mm = None if m else MAKE_PROGRESS_RE.match(line.strip())
        if m or mm:
            last = f"{m.group(1)}/{m.group(2)} steps" if m else f"{mm.group(1)}%"
            t = time.monotonic()
            if t - last_shown >= 5.0:  # a line every 5 s: enough to see it move, little enough to read
                last_shown = t
                what = (m.group(3) if m else mm.group(2)).split(" ")[-1]
                log(f"  [{last}] {int(t - start)} s  {what[-70:]}")
    rc = p.wait()
    text = "".join(lines)
    (bd / "student-build.log").write_text(text)
    if rc == 0 and "no work to do" in text:
        log("  build: up to date")
    elif last is not None:
        log(f"  build {'done' if rc == 0 else 'FAILED'}: {last} in {int(time.monotonic() - start)} s")
    return rc == 0, text


def list_tests(bd):
    p = subprocess.run(["ctest", "--test-dir", str(bd), "--show-only=json-v1"], capture_output=True, text=True)
    if p.returncode != 0:
        raise UsageError(f"ctest could not list the tests:\n{tail(p.stderr)}")
    tests = {}
    for t in json.loads(p.stdout).get("tests", []):
        labels = []
        for prop in t.get("properties", []):
            if prop.get("name") == "LABELS":
                labels = prop.get("value", [])
        tests[t["name"]] = labels
    return tests


def cmake_regex_escape(name):
    return re.sub(r"([.\[\]()*+?^$|\\])", r"\\\1", name)


def first_message(text, exercise=None):
    """The most telling line of a failing test's output: the stub's message, else the first failure."""
    lines = (text or "").splitlines()
    for l in lines:
        if "not written yet: exercise" in l:
            return l.strip()[:160]
    for key in ("Failure", "error:", "failure:", "Exception", "what():", "SegFault", "Child aborted", "FAIL"):
        for i, l in enumerate(lines):
            if key in l:
                msg = l.strip()
                if key == "Failure" and i + 1 < len(lines):
                    msg += " " + lines[i + 1].strip()
                return msg[:160]
    return (lines[-1].strip() if lines else "")[:160]


DETAIL_LINES = 40  # the most lines of one test's output a record keeps (the rest: run the test alone)


def failure_detail(text):
    """What a failing test said, whole: GoogleTest's failure blocks (file:line, the expression, the values),
    or for another program (a lesson executable's run) the end of its output. At most DETAIL_LINES lines."""
    lines = (text or "").rstrip().splitlines()
    keep, inside = [], False
    for l in lines:
        if l.startswith("[ RUN      ]"):
            inside = True
            continue
        if l.startswith(("[  FAILED  ]", "[       OK ]", "[  SKIPPED ]")):
            inside = False
            continue
        if inside:
            keep.append(l.rstrip())
    if not any(l.strip() for l in keep):
        keep = [l.rstrip() for l in lines if not l.startswith(("Note: Google Test filter", "[==========]",
                                                               "[----------]"))][-DETAIL_LINES:]
    if len(keep) > DETAIL_LINES:
        keep = keep[:DETAIL_LINES - 1] + [f"... ({len(keep) - DETAIL_LINES + 1} more lines: run the test alone)"]
    return "\n".join(keep)


def run_one_command(bd, name):
    """The command that runs one CTest test with its whole output (what a student types next)."""
    return f"ctest --test-dir {bd} -R '^{cmake_regex_escape(name)}$' --output-on-failure"


def run_tests(bd, names, jobs=None, timeout=600):
    """Runs the named CTest tests. Returns {name: (status, message, output)} with status passed, failed,
    crashed, skipped or not built; message is the telling line, output the whole failure (failure_detail)."""
    if not names:
        return {}
    junit = bd / "student-junit.xml"
    if junit.exists():
        junit.unlink()
    regex = "^(" + "|".join(cmake_regex_escape(n) for n in sorted(names)) + ")$"
    cmd = ["ctest", "--test-dir", str(bd), "-R", regex, "--output-junit", str(junit), "--timeout", str(timeout),
           "-j", str(jobs or os.cpu_count() or 2)]
    note(f"running {len(names)} test(s) ...")
    p = subprocess.run(cmd, capture_output=True, text=True)
    (bd / "student-ctest.log").write_text(p.stdout + p.stderr)
    results = {}
    if junit.exists():
        for tc in ET.parse(junit).getroot().iter("testcase"):
            name, status = tc.get("name"), tc.get("status")
            out = tc.findtext("system-out") or ""
            skipped = tc.find("skipped")
            failure = tc.find("failure")
            if status == "run" and failure is None:
                results[name] = ("passed", "", "")
            elif status in ("notrun", "disabled") or skipped is not None:
                why = (skipped.get("message") if skipped is not None else "") or ""
                if "Unable to find executable" in why or "Unable to find executable" in out:
                    results[name] = ("not built", "its executable did not build", "")
                else:
                    results[name] = ("skipped", first_message(out) or why, "")
            else:
                msg = (failure.get("message") if failure is not None else "") or ""
                crashed = any(k in msg + out for k in ("SegFault", "Child aborted", "Subprocess aborted",
                                                        "Illegal", "Exception: ", "Timeout"))
                results[name] = ("crashed" if crashed and "not written yet" not in out else "failed",
                                 first_message(out) or msg, failure_detail(out) or msg)
    for n in names:
        results.setdefault(n, ("failed", "no result from ctest (see student-ctest.log)", ""))
    return results


def match_tests(region, tests):
    """The CTest tests a region's patterns name: [(name, device)], and patterns that matched none."""
    hits, missing = [], []
    for pat in region.tests:
        got = [n for n in tests if fnmatch.fnmatchcase(n, pat)]
        if not got:
            missing.append(pat)
        for n in got:
            if n not in [h[0] for h in hits]:
                hits.append((n, "gpu" if "gpu" in tests[n] else "cpu"))
    return hits, missing


def targets_to_build(targets, regions, gpu):
    """(what to build, what is left out). Without a GPU the GPU test programs (tests/test_NN_*_gpu.cpp: GPU
    tests only) would only report "skipped": not building them saves most of the build. The lesson's code,
    kernels included, is still compiled: the CPU tests link it, or, when every test of the regions is a GPU
    test, the lessons' own libraries are built instead (never an empty target list)."""
    unbuilt = set() if gpu else {t for t in targets if t.endswith("_gpu")}
    kept = [t for t in targets if t not in unbuilt]
    if not kept:
        kept = sorted({f"tvllm_l{r.lesson}" for r in regions})
    return kept, unbuilt


def evaluate(ws, bd, regions, jobs=None, extra_cmake=(), log=note):
    """Configures and builds what the regions' tests need, runs them. Returns (per-region results, build_ok)."""
    configure(ws, bd, list(extra_cmake))
    targets, unbuilt = targets_to_build(targets_for(ws, regions), regions, have_gpu())
    log(f"building {' '.join(targets)} in {bd} ..." +
        (f" (not {' '.join(sorted(unbuilt))}: no GPU here)" if unbuilt else ""))
    ok, build_log = build(ws, bd, targets, jobs, log)
    if not ok:
        errors = [l for l in build_log.splitlines() if "error" in l.lower()][:12]
        log("the build failed (the exercises whose tests did not build fail); first errors:\n  " +
            "\n  ".join(errors) + f"\n  (whole log: {bd / 'student-build.log'})")
    tests = list_tests(bd)
    per = {}
    wanted = set()
    for r in regions:
        hits, missing = match_tests(r, tests)
        per[r.id] = (hits, missing)
        wanted |= {h[0] for h in hits}
    res = run_tests(bd, wanted, jobs)
    suites = suite_targets(ws) if unbuilt else {}
    out = {}
    for r in regions:
        hits, missing = per[r.id]
        rows = [{"name": n, "device": d, "status": res[n][0], "message": res[n][1], "output": res[n][2]}
                for n, d in hits]
        for pat in list(missing):
            suite = pat.split(".")[0].split("/")[-1]
            owners = {t for st, ts in suites.items() if fnmatch.fnmatchcase(st, suite) for t in ts}
            if owners and owners <= unbuilt:  # a GPU test program left unbuilt: its tests are skipped
                missing.remove(pat)
                rows.append({"name": pat, "device": "gpu", "status": "skipped",
                             "message": "needs a GPU (its test program is not built on a machine without one)"})
        for pat in missing:
            rows.append({"name": pat, "device": "?", "status": "not built" if not ok else "missing",
                         "message": "no test of that name was built" if not ok else
                         "no CTest test matches this pattern (a defect of the marker)"})
        out[r.id] = rows
    return out, ok


def counts(rows):
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for t in rows:
        c["passed" if t["status"] == "passed" else "skipped" if t["status"] == "skipped" else "failed"] += 1
    return c


# ---- grade ------------------------------------------------------------------------------------------------


BAD = ("failed", "crashed", "not built", "missing")
STUB_MSG_RE = re.compile(r"not written yet: exercise (\d\d\.\d+)")


def exercise_key(ex):
    return (ex[:2], int(ex[3:]))


def assign_blame(regions, results, written):
    """Decides, for every exercise, whether its failing tests are its own fault.

    regions: {id: Region} (tests, needs), results: {id: [test rows]}, written: {id: bool}. A test may be
    listed by several exercises, and an exercise may need others (`Needs:`); a failing test is charged to
    the exercises that can explain it: one whose stub message it printed (`not written yet: exercise
    NN.K`), else the earlier written exercises, among those listing it or needed by them, that already
    fail (the earliest first in the message). An
    exercise whose failing tests are all charged elsewhere is "blocked by" those; one with a failing test
    nothing earlier explains fails. Sets row["charged_to"] on every failing row; returns
    {id: (verdict, [blockers])}."""
    order = sorted(regions, key=exercise_key)
    owners = {}
    for ex in order:
        for t in results.get(ex, []):
            owners.setdefault(t["name"], set()).add(ex)

    def candidates(name, ex):
        c = set(owners.get(name, ())) | {ex}
        for o in list(c):
            c |= set(regions[o].needs) if o in regions else set()
        return c

    failing, out = set(), {}
    for ex in order:
        rows = results.get(ex, [])
        bad = [t for t in rows if t["status"] in BAD]
        if not written.get(ex, False):
            failing.add(ex)
            for t in bad:
                t["charged_to"] = [ex]
            out[ex] = ("not written", [])
            continue
        own, blockers = [], set()
        for t in bad:
            text = (t.get("message") or "") + "\n" + (t.get("output") or "")
            why = {m for m in STUB_MSG_RE.findall(text) if m != ex}
            # A stub is blamed only where its message shows (above): a test that never ran it is not its
            # fault. A written exercise that fails is blamed for the tests it may have caused.
            cands = candidates(t["name"], ex) - {ex}
            why |= {c for c in cands if exercise_key(c) < exercise_key(ex) and c in failing and written.get(c)}
            if why:
                t["charged_to"] = sorted(why, key=exercise_key)
                blockers |= why
            else:
                t["charged_to"] = [ex]
                own.append(t)
        if own:
            failing.add(ex)
            verdict = "build failed" if any(t["status"] == "not built" for t in own) else "failed"
            out[ex] = (verdict, sorted(blockers, key=exercise_key))
        elif bad:
            names = sorted(blockers, key=exercise_key)
            out[ex] = ("blocked by " + ", ".join(names), names)
        elif any(t["status"] == "skipped" for t in rows):
            out[ex] = ("incomplete", [])
        else:
            out[ex] = ("passed", [])
    return out


def grade_workspace(ws, lesson, source, bd, jobs=None, student=None, extra_cmake=()):
    """Grades one workspace. Returns the gradebook record (a dict) and the exit status."""
    state = json.loads((ws / STATE_FILE).read_text()) if (ws / STATE_FILE).exists() else {}
    # The exercise list and their tests come from the course's repository, never from the student's copy.
    ref = find_regions(source, lesson)
    mine = find_regions(ws, lesson)
    if not ref:
        raise UsageError(f"lesson {lesson} has no marked exercises in {source}")
    problems = [f"exercise {i}: markers not found in the workspace" for i in ref if i not in mine]
    results, build_ok = evaluate(ws, bd, list(ref.values()), jobs, extra_cmake)
    gpu = have_gpu()
    record = {"tool": "tiny-vllm student.py", "version": 2, "student": student or ws.name, "workspace": str(ws),
              "build_dir": str(bd), "lesson": lesson, "graded_at": now(),
              "source_commit": git_commit(source) or state.get("source_commit"),
              "gpu": gpu, "build_ok": build_ok, "problems": problems, "exercises": []}
    written = {}
    for ex, r in ref.items():
        body = mine[ex].body if ex in mine else None
        written[ex] = body is not None and _norm(body) != _norm(r.stub_lines())
    verdicts = assign_blame(ref, results, written)
    worst = EXIT_PASS
    for ex, r in ref.items():
        rows = results[ex]
        c = counts(rows)
        body = mine[ex].body if ex in mine else None
        revealed = ex in state.get("revealed", {})
        same_as_solution = body is not None and _norm(body) == _norm(r.body)
        verdict, blockers = verdicts[ex]
        if verdict == "incomplete":
            worst = max(worst, EXIT_INCOMPLETE) if worst != EXIT_FAIL else worst
        elif verdict != "passed":
            worst = EXIT_FAIL
        if revealed and verdict == "passed":
            verdict = "passed (revealed)"
        record["exercises"].append({
            "id": ex, "title": r.title, "file": r.path, "verdict": verdict, "blocked_by": blockers
            if verdict.startswith("blocked") else [], "written": written[ex], "revealed": revealed,
            "identical_to_solution": same_as_solution, **c, "tests": rows})
    record["verdict"] = {EXIT_PASS: "pass", EXIT_FAIL: "fail", EXIT_INCOMPLETE: "incomplete"}[worst]
    record["exit_code"] = worst
    return record, worst


def print_grade(record, verbose=False):
    """The grade table. Under an exercise that fails: each failing test it is charged with, its whole
    GoogleTest message (the expression and the values), and the command that runs that one test; under
    a blocked one, what blocks it. --verbose: every test that did not pass, messages uncut."""
    ex = record["exercises"]
    bd = record.get("build_dir") or DEFAULT_BUILD
    note("")
    note(f"lesson {record['lesson']} grade for {record['student']}   (GPU: {record['gpu'] or 'none'})")
    note(f"{'exercise':<9} {'title':<42} {'passed':>6} {'failed':>6} {'skipped':>7}  verdict")
    pad = " " * 11
    for e in ex:
        note(f"{e['id']:<9} {e['title'][:42]:<42} {e['passed']:>6} {e['failed']:>6} {e['skipped']:>7}  {e['verdict']}")
        if e["verdict"] == "not written" and not verbose:
            continue  # the verdict says it all; --verbose lists the tests
        bad = [t for t in e["tests"] if t["status"] in BAD]
        mine = [t for t in bad if t.get("charged_to", [e["id"]]) == [e["id"]]]
        if e["verdict"].startswith("blocked") and not verbose:
            for t in bad[:3]:
                note(f"{pad}{t['status']}: {t['name']}: {t['message']}")
            if len(bad) > 3:
                note(f"{pad}... and {len(bad) - 3} more, all charged to {', '.join(e['blocked_by'])}")
            continue
        shown = (mine or bad) if not verbose else [t for t in e["tests"] if t["status"] != "passed"]
        if not verbose and e["verdict"] != "incomplete":
            shown = [t for t in shown if t["status"] != "skipped"]
        limit = None if verbose else 3
        for t in shown[:limit]:
            note(f"{pad}{t['status']}: {t['name']}")
            detail = t.get("output") or t.get("message") or ""
            lines = detail.splitlines() if verbose else detail.splitlines()[:DETAIL_LINES // 2]
            for l in lines:
                note(f"{pad}  | {l}")
            if len(detail.splitlines()) > len(lines):
                note(f"{pad}  | ... (--verbose, or run it alone, shows the rest)")
            if t["status"] in BAD and t["status"] not in ("missing", "not built"):
                note(f"{pad}  run it alone: {run_one_command(bd, t['name'])}")
            other = [c for c in t.get("charged_to", []) if c != e["id"]]
            if other:
                note(f"{pad}  (charged to {', '.join(other)})")
        if limit and len(shown) > limit:
            note(f"{pad}... and {len(shown) - limit} more (--verbose lists them)")
    for p in record.get("problems", []):
        note(f"  problem: {p}")
    failed = [e["id"] for e in ex if e["verdict"] not in ("passed", "passed (revealed)", "incomplete")]
    skipped = [e for e in ex if e["skipped"]]
    revealed = [e["id"] for e in ex if e["revealed"]]
    n_skip = sum(e["skipped"] for e in ex)
    tail_note = f"; revealed (no credit): {', '.join(revealed)}" if revealed else ""
    if failed:
        extra = f"; {n_skip} GPU test(s) could not run here" if n_skip else ""
        named = [e["id"] + ("" if e["verdict"] == "failed" else f" ({e['verdict']})") for e in ex
                 if e["id"] in failed]
        note(f"FAIL: lesson {record['lesson']}: {len(failed)} of {len(ex)} exercise(s) fail: {', '.join(named)}"
             f"{extra}{tail_note}")
    elif skipped:
        note(f"INCOMPLETE: lesson {record['lesson']}: no test failed, but {n_skip} GPU test(s) of "
             f"{', '.join(e['id'] for e in skipped)} could not run (no CUDA GPU here). Skipped is not passed: "
             f"grade again on a GPU machine{tail_note}")
    else:
        note(f"PASS: lesson {record['lesson']}: all {len(ex)} exercise(s) pass, every test ran{tail_note}")


def csv_path(json_path, csv_arg=None):
    """The CSV gradebook's path: --csv, else beside the JSON one (g.json -> g.csv), else none."""
    if csv_arg:
        return Path(csv_arg)
    return Path(json_path).with_suffix(".csv") if json_path else None


def write_csv(path, records):
    """One row per submission: student, lesson, one column per exercise (its verdict: passed, passed
    (revealed), failed, blocked by NN.K, not written, incomplete, build failed), the counts and the verdict.
    Exercise columns are the union over the records (a class graded at different lessons leaves cells
    empty)."""
    ids = sorted({e["id"] for r in records for e in r.get("exercises", [])}, key=exercise_key)
    kinds = ("passed", "failed", "blocked", "not written", "incomplete")

    def kind(v):
        return "passed" if v.startswith("passed") else "blocked" if v.startswith("blocked") else \
            "failed" if v == "build failed" else v

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "lesson", *ids, *(k.replace(" ", "_") for k in kinds), "revealed", "verdict"])
        for r in records:
            by_id = {e["id"]: e for e in r.get("exercises", [])}
            verdicts = [by_id[i]["verdict"] if i in by_id else "" for i in ids]
            tally = [sum(1 for e in by_id.values() if kind(e["verdict"]) == k) for k in kinds]
            revealed = sum(1 for e in by_id.values() if e.get("revealed"))
            w.writerow([r.get("student"), r.get("lesson"), *verdicts, *tally, revealed, r.get("verdict")])


def cmd_grade(args):
    ws = Path(args.workspace).resolve()
    state = json.loads((ws / STATE_FILE).read_text()) if (ws / STATE_FILE).exists() else {}
    lesson = f"{int(args.lesson):02d}" if args.lesson else state.get("lesson")
    if not lesson:
        raise UsageError("say which lesson to grade (--lesson NN): this tree has no student state")
    source = source_of(args, state)
    bd = Path(args.build_dir).resolve() if args.build_dir else ws / DEFAULT_BUILD
    record, rc = grade_workspace(ws, lesson, source, bd, args.jobs, args.student)
    print_grade(record, args.verbose)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        note(f"gradebook record: {args.json}")
    cp = csv_path(args.json, args.csv)
    if cp:
        write_csv(cp, [record])
        note(f"gradebook row (CSV): {cp}")
    return rc


def cmd_grade_all(args):
    subs = Path(args.submissions).resolve()
    source = source_of(args)
    scratch = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="tvllm-grade-"))
    book = {"tool": "tiny-vllm student.py", "version": 2, "graded_at": now(), "source_commit": git_commit(source),
            "gpu": have_gpu(), "submissions": []}
    worst = EXIT_PASS
    dirs = sorted(d for d in subs.iterdir() if d.is_dir())
    for d in dirs:
        state = json.loads((d / STATE_FILE).read_text()) if (d / STATE_FILE).exists() else {}
        lesson = f"{int(args.lesson):02d}" if args.lesson else state.get("lesson")
        note(f"\n=== {d.name} (lesson {lesson}) ===")
        try:
            if not lesson:
                raise UsageError(f"{d}: no {STATE_FILE} and no --lesson")
            # A pristine copy: the submission's lessons/ (the student's work) over the course's own files at
            # that lesson, so a changed test, CMake file or common/ cannot change the grade.
            ws = scratch / d.name
            make_workspace(source, lesson, ws, stubbed=set())
            for p in (ws / "lessons").glob("[0-9][0-9]_*"):
                shutil.rmtree(p)
            for p in sorted((d / "lessons").glob("[0-9][0-9]_*/**/*")):
                rel = p.relative_to(d)
                fl = file_lesson(rel.as_posix())
                if p.is_file() and fl is not None and fl <= lesson:
                    (ws / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(p, ws / rel)
            if state:
                (ws / STATE_FILE).write_text(json.dumps(state))
            record, rc = grade_workspace(ws, lesson, source, ws / DEFAULT_BUILD, args.jobs, d.name)
            print_grade(record, args.verbose)
        except UsageError as e:
            note(f"error: {e}")
            record, rc = {"student": d.name, "lesson": lesson, "verdict": "error", "error": str(e),
                          "exit_code": EXIT_FAIL}, EXIT_FAIL
        book["submissions"].append(record)
        worst = EXIT_FAIL if EXIT_FAIL in (worst, rc) else max(worst, rc)
    note(f"\n{'student':<24} {'lesson':<6} {'passed':>6} {'revealed':>8} {'of':>3}  verdict")
    for r in book["submissions"]:
        ex = r.get("exercises", [])
        passed = sum(1 for e in ex if e["verdict"] == "passed")
        revealed = sum(1 for e in ex if e["revealed"])
        note(f"{r['student'][:24]:<24} {str(r.get('lesson')):<6} {passed:>6} {revealed:>8} {len(ex):>3}  {r['verdict']}")
    if args.json:
        Path(args.json).write_text(json.dumps(book, indent=2) + "\n")
        note(f"gradebook: {args.json}")
    cp = csv_path(args.json, args.csv)
    if cp:
        write_csv(cp, book["submissions"])
        note(f"gradebook (CSV, one row per student): {cp}")
    return worst


# ---- check (course authors, CI) ---------------------------------------------------------------------------


def cmd_check(args):
    source = source_of(args)
    lesson = f"{int(args.lesson):02d}"
    regions = find_regions(source, lesson)
    if not regions:
        note(f"lesson {lesson} has no marked exercises: nothing to check")
        return EXIT_PASS
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix=f"tvllm-check{lesson}-"))
    ws = work / "workspace"
    # The build inside the workspace, as `grade` does: the same relative paths, so ccache serves one from the other.
    bd = Path(args.build_dir).resolve() if args.build_dir else ws / DEFAULT_BUILD
    extra = [f"-D{d}" for d in (args.define or [])]
    ids = list(regions)
    lesson_files = sorted({r.path for r in regions.values()})
    defects, skipped = [], []
    phases = [("stubs", set(ids), ids)]  # (name, stubbed ids, exercises whose tests run)
    if len(ids) > 1 and not args.quick:
        phases += [(f"only {i} stubbed", {i}, [i]) for i in ids]
    phases.append(("solutions", set(), ids))
    if args.quick:
        # One workspace for every lesson, all solved but this lesson's files: the student.lessonNN CTest
        # tests share it (--work-dir), so each builds only its lesson's files and what links them again.
        make_workspace(source, lessons_of(source)[-1], ws, stubbed=set())
    else:
        make_workspace(source, lesson, ws)
    summary = {i: {"stub": None, "solution": None} for i in ids}
    gpu = have_gpu()
    gpu_only = set()  # exercises whose tests all need a GPU: without one, isolating them checks nothing
    for name, stubbed, run_ids in phases:
        if len(stubbed) == 1 and not gpu and stubbed <= gpu_only:
            note(f"\n--- {name}: skipped (its tests all need a GPU, and there is none here) ---")
            continue
        for rel in lesson_files:  # re-render only the lesson's files: unchanged ones keep their timestamps
            copy_lesson_file(source, ws, rel, lesson, stubbed)
        note(f"\n--- {name} ---")
        results, _ = evaluate(ws, bd, [regions[i] for i in run_ids], args.jobs, extra)
        for i in run_ids:
            rows = results[i]
            c = counts(rows)
            if rows and all(t["device"] == "gpu" for t in rows):
                gpu_only.add(i)
            for t in rows:
                if t["status"] == "skipped":
                    skipped.append(f"{i}: {t['name']} ({t['message']})")
                elif t["status"] == "crashed":
                    defects.append(f"{i} {name}: {t['name']} crashed: {t['message']}")
                elif t["status"] == "missing":
                    defects.append(f"{i}: {t['name']}: {t['message']}")
                elif stubbed and i in stubbed and t["status"] == "passed":
                    defects.append(f"{i} {name}: {t['name']} PASSES on the stub (it does not test this region, "
                                   "or the stub passes by accident)")
                elif not stubbed and t["status"] != "passed":
                    defects.append(f"{i} solution: {t['name']} {t['status']}: {t['message']}")
            isolated = stubbed == {i}  # only this exercise stubbed: its tests must fail because of it
            if isolated or (name == "stubs" and summary[i]["stub"] is None):
                summary[i]["stub"] = c
            if isolated and c["failed"] and not any(f"not written yet: exercise {i}" in t["message"] for t in rows):
                defects.append(f"{i} {name}: its tests fail, but none with the stub's message "
                               f"'not written yet: exercise {i}'")
            if not stubbed:
                summary[i]["solution"] = c
            note(f"  {i} {regions[i].title[:40]:<40} passed {c['passed']}, failed {c['failed']}, skipped {c['skipped']}")
    note(f"\nlesson {lesson} student-mode check ({len(ids)} exercise(s)):")
    note(f"{'exercise':<9} {'title':<40} {'on its stub':<22} {'on the solution':<22}")
    for i in ids:
        s, o = summary[i]["stub"], summary[i]["solution"]
        fmt = lambda c: "-" if c is None else f"{c['failed']} fail/{c['passed']} pass/{c['skipped']} skip"
        note(f"{i:<9} {regions[i].title[:40]:<40} {fmt(s):<22} {fmt(o):<22}")
    for d in defects:
        note(f"DEFECT: {d}")
    for s in sorted(set(skipped)):
        note(f"skipped: {s}")
    if not args.keep and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    if defects:
        note(f"FAIL: lesson {lesson}: {len(defects)} defect(s)")
        return EXIT_FAIL
    if skipped and gpu:
        # A GPU is here, so nothing should have skipped: a pass now would hide the tests that did not run.
        note(f"INCOMPLETE: lesson {lesson}: {len(set(skipped))} test(s) skipped on a machine with a GPU ({gpu}); "
             "the check is not a pass until they run")
        return EXIT_INCOMPLETE
    if skipped:
        note(f"PASS (CPU part): lesson {lesson}: every test that could run fails on its stub and passes on its "
             f"solution; {len(set(skipped))} GPU test(s) were skipped here (no GPU): run the check on a GPU "
             "machine for the rest")
        return EXIT_PASS if not args.strict else EXIT_INCOMPLETE
    note(f"PASS: lesson {lesson}: every exercise's tests fail on its stub and pass on its solution")
    return EXIT_PASS


# ---- command line -----------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(prog="student.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p, source=True):
        if source:
            p.add_argument("--source", help="the course repository (default: the one this script is in, "
                                            "or the workspace's recorded source)")
        p.add_argument("--jobs", "-j", type=int, help="build/test parallelism")

    p = sub.add_parser("start", help="make a student workspace for lesson NN")
    p.add_argument("--lesson", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--source")
    p = sub.add_parser("next", help="move a workspace on to the next lesson")
    p.add_argument("--workspace", default=".", help="default: the current directory")
    p.add_argument("--source")
    p = sub.add_parser("reveal", help="replace one exercise's stub by its solution (recorded)")
    p.add_argument("--workspace", default=".", help="default: the current directory")
    p.add_argument("--exercise", required=True, help="NN.K, e.g. 01.3")
    p.add_argument("--source")
    p = sub.add_parser("grade", help="build and run a lesson's exercise tests; print the grade table")
    p.add_argument("--workspace", default=".")
    p.add_argument("--lesson")
    p.add_argument("--json", help="write the gradebook record here (and its CSV row beside it, .csv)")
    p.add_argument("--csv", help="write the CSV row here (default: beside --json)")
    p.add_argument("--build-dir", help=f"default: WORKSPACE/{DEFAULT_BUILD}")
    p.add_argument("--student", help="the name in the record (default: the workspace folder's name)")
    p.add_argument("--verbose", "-v", action="store_true", help="list every test that did not pass")
    common(p)
    p = sub.add_parser("grade-all", help="grade every workspace under a folder of submissions")
    p.add_argument("--submissions", required=True, help="one workspace per sub-folder (named after the student)")
    p.add_argument("--lesson", help="default: each workspace's own lesson")
    p.add_argument("--json", help="write the gradebook here (and the CSV beside it, .csv)")
    p.add_argument("--csv", help="write the CSV gradebook here (default: beside --json)")
    p.add_argument("--work-dir", help="where the graded copies and their builds go (default: a temp dir)")
    p.add_argument("--verbose", "-v", action="store_true", help="list every test that did not pass")
    common(p)
    p = sub.add_parser("check", help="CI/authors: each exercise's tests fail on its stub, pass on its solution")
    p.add_argument("--lesson", required=True)
    p.add_argument("--work-dir", help="keep the workspace and build here (reused on the next run)")
    p.add_argument("--build-dir", help="default: WORK_DIR/workspace/" + DEFAULT_BUILD)
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--quick", action="store_true",
                   help="CI: skip the one-exercise-stubbed builds, and build in a workspace holding every "
                        "lesson (solved but this one), which the checks of several lessons may share "
                        "through one --work-dir")
    p.add_argument("--strict", action="store_true", help="exit 3 when GPU tests were skipped")
    p.add_argument("-D", dest="define", action="append", help="a CMake definition for the workspace build")
    common(p)
    p = sub.add_parser("list", help="list the marked exercises")
    p.add_argument("--lesson")
    p.add_argument("--source")

    args = ap.parse_args(argv)
    try:
        return {"start": cmd_start, "next": cmd_next, "reveal": cmd_reveal, "grade": cmd_grade,
                "grade-all": cmd_grade_all, "check": cmd_check, "list": cmd_list}[args.cmd](args)
    except UsageError as e:
        print(f"student.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
