#!/usr/bin/env python3
"""Unit tests of student.py's own logic, without a build (CTest: student.tool, well under a second):
the markers (Needs:), who a failing test is charged to, the failure text a grade shows, the CSV gradebook,
and the lesson-11 claims (11.1 and 11.2 graded without the engine; 11.3 needs them).

The same scenario on a real build (a lesson-11 workspace with one planted bug) is planted_bug.py, run by
the CTest test student.lesson11.blame (label student)."""
import csv
import io
import sys
import tempfile
import unittest
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import student  # noqa: E402


def region(ex, tests, needs=""):
    text = (f"// --- exercise {ex}: t{ex} ---\n// Task: do it.\n// Tests: {' '.join(tests)}\n"
            + (f"// Needs: {needs}\n" if needs else "") + "// --- solution ---\nx;\n"
            f"// --- end of exercise {ex} ---\n")
    (r,) = student.parse_regions(text, f"lessons/{ex[:2]}_x/a.cpp")
    return r


def row(name, status="passed", message="", output=""):
    return {"name": name, "device": "cpu", "status": status, "message": message, "output": output}


# Lesson 11's shape: 11.1 has a test of its own (A) and shares S with 11.2; 11.3's tests (E) run the scheduler,
# so 11.3 needs 11.1 and 11.2.
def lesson11(a="passed", s="passed", e="passed", b="passed", e_msg=""):
    regions = {"11.1": region("11.1", ["A", "S"]), "11.2": region("11.2", ["S", "B"]),
               "11.3": region("11.3", ["E"], needs="11.1 11.2")}
    results = {"11.1": [row("A", a), row("S", s)], "11.2": [row("S", s), row("B", b)],
               "11.3": [row("E", e, e_msg)]}
    return regions, results


ALL_WRITTEN = {"11.1": True, "11.2": True, "11.3": True}


class Markers(unittest.TestCase):
    def test_needs_is_parsed(self):
        self.assertEqual(region("11.3", ["E"], needs="11.1, 11.2").needs, ["11.1", "11.2"])

    def test_bad_needs_is_refused(self):
        for bad in ("11", "eleven", "11.3"):  # not an id; itself
            with self.assertRaises(student.UsageError):
                region("11.3", ["E"], needs=bad)


class Blame(unittest.TestCase):
    def verdicts(self, regions, results, written=ALL_WRITTEN):
        return {k: v[0] for k, v in student.assign_blame(regions, results, written).items()}

    def test_all_pass(self):
        self.assertEqual(self.verdicts(*lesson11()), {"11.1": "passed", "11.2": "passed", "11.3": "passed"})

    def test_a_bug_in_the_first_blocks_the_later_ones(self):
        # The case: a bug in 11.1 fails its own test, the shared test and the engine's test.
        v = self.verdicts(*lesson11(a="failed", s="failed", e="failed"))
        self.assertEqual(v, {"11.1": "failed", "11.2": "blocked by 11.1", "11.3": "blocked by 11.1"})

    def test_a_shared_failure_goes_to_the_earliest(self):
        v = self.verdicts(*lesson11(s="failed", e="failed"))
        self.assertEqual(v, {"11.1": "failed", "11.2": "blocked by 11.1", "11.3": "blocked by 11.1"})

    def test_a_failure_of_its_own_is_not_blocked(self):
        v = self.verdicts(*lesson11(a="failed", b="failed"))
        self.assertEqual(v, {"11.1": "failed", "11.2": "failed", "11.3": "passed"})

    def test_the_last_fails_alone(self):
        v = self.verdicts(*lesson11(e="crashed"))
        self.assertEqual(v, {"11.1": "passed", "11.2": "passed", "11.3": "failed"})

    def test_charged_to_is_recorded(self):
        regions, results = lesson11(a="failed", s="failed", e="failed")
        student.assign_blame(regions, results, ALL_WRITTEN)
        self.assertEqual(results["11.2"][0]["charged_to"], ["11.1"])
        self.assertEqual(results["11.1"][1]["charged_to"], ["11.1"])

    def test_a_stub_message_blocks_even_a_later_exercise(self):
        regions, results = lesson11(e="failed", e_msg="not written yet: exercise 11.2 after the step")
        written = dict(ALL_WRITTEN, **{"11.2": False})
        results["11.2"] = [row("S", "passed"), row("B", "failed", "not written yet: exercise 11.2 after")]
        v = self.verdicts(regions, results, written)
        self.assertEqual(v, {"11.1": "passed", "11.2": "not written", "11.3": "blocked by 11.2"})

    def test_a_stub_is_blamed_only_where_its_message_shows(self):
        # 06.5 needs 06.3 (one of its tests compares with v2), but its own v4 tests never run v2: with v2
        # still a stub, a v4 failure without v2's message is 06.5's own.
        regions = {"06.3": region("06.3", ["V2"]), "06.5": region("06.5", ["V4", "Agree"], needs="06.3")}
        written = {"06.3": False, "06.5": True}
        results = {"06.3": [row("V2", "failed", "not written yet: exercise 06.3 v2")],
                   "06.5": [row("V4", "failed", "Expected equality"), row("Agree", "passed")]}
        self.assertEqual(self.verdicts(regions, results, written), {"06.3": "not written", "06.5": "failed"})
        results["06.5"] = [row("V4", "passed"), row("Agree", "failed", "", "not written yet: exercise 06.3 v2")]
        self.assertEqual(self.verdicts(regions, results, written)["06.5"], "blocked by 06.3")

    def test_a_gpu_only_stub_without_a_gpu_is_not_written(self):
        regions = {"04.2": region("04.2", ["G"])}
        results = {"04.2": [row("G", "skipped", "needs a GPU")]}
        self.assertEqual(self.verdicts(regions, results, {"04.2": False}), {"04.2": "not written"})
        self.assertEqual(self.verdicts(regions, results, {"04.2": True}), {"04.2": "incomplete"})

    def test_build_failed(self):
        regions = {"01.1": region("01.1", ["T"])}
        results = {"01.1": [row("T", "not built", "its executable did not build")]}
        self.assertEqual(self.verdicts(regions, results, {"01.1": True}), {"01.1": "build failed"})


GTEST_OUT = """Note: Google Test filter = Scheduler11.X
[==========] Running 1 test from 1 test suite.
[ RUN      ] Scheduler11.X
../tests/test_11_scheduler.cpp:300: Failure
Expected equality of these values:
  batch.num_sequences()
    Which is: 2
  1
[  FAILED  ] Scheduler11.X (0 ms)
[==========] 1 test from 1 test suite ran. (0 ms total)
"""


class Messages(unittest.TestCase):
    def test_the_whole_googletest_failure_with_its_values(self):
        d = student.failure_detail(GTEST_OUT)
        self.assertEqual(d.splitlines(), ["../tests/test_11_scheduler.cpp:300: Failure",
                                          "Expected equality of these values:", "  batch.num_sequences()",
                                          "    Which is: 2", "  1"])

    def test_another_program_gives_its_last_lines(self):
        out = "\n".join(f"line {i}" for i in range(100))
        d = student.failure_detail(out).splitlines()
        self.assertEqual(len(d), student.DETAIL_LINES)
        self.assertEqual(d[-1], "line 99")

    def test_run_one_command_escapes_the_name(self):
        self.assertEqual(student.run_one_command("b", "Suite.Name/v1"),
                         "ctest --test-dir b -R '^Suite\\.Name/v1$' --output-on-failure")


class Gradebook(unittest.TestCase):
    def test_csv_one_row_per_student(self):
        def ex(i, verdict, revealed=False):
            return {"id": i, "verdict": verdict, "revealed": revealed}
        records = [
            {"student": "alice", "lesson": "11", "verdict": "fail",
             "exercises": [ex("11.1", "failed"), ex("11.2", "blocked by 11.1"), ex("11.3", "not written")]},
            {"student": "bob", "lesson": "11", "verdict": "incomplete",
             "exercises": [ex("11.1", "passed"), ex("11.2", "passed (revealed)", True), ex("11.3", "incomplete")]},
            {"student": "carol", "lesson": None, "verdict": "error"},
        ]
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "g.csv"
            student.write_csv(p, records)
            rows = list(csv.reader(io.StringIO(p.read_text())))
        self.assertEqual(rows[0], ["student", "lesson", "11.1", "11.2", "11.3", "passed", "failed", "blocked",
                                   "not_written", "incomplete", "revealed", "verdict"])
        self.assertEqual(rows[1], ["alice", "11", "failed", "blocked by 11.1", "not written", "0", "1", "1", "1",
                                   "0", "0", "fail"])
        self.assertEqual(rows[2], ["bob", "11", "passed", "passed (revealed)", "incomplete", "2", "0", "0", "0",
                                   "1", "1", "incomplete"])
        self.assertEqual(rows[3][:2], ["carol", ""])
        self.assertEqual(rows[3][-1], "error")

    def test_csv_path_beside_the_json(self):
        self.assertEqual(student.csv_path("out/g.json"), Path("out/g.csv"))
        self.assertEqual(student.csv_path("g.json", "x.csv"), Path("x.csv"))
        self.assertIsNone(student.csv_path(None))


class Lesson11Markers(unittest.TestCase):
    """The course's own lesson-11 regions: what the chapter's exercise table says about them."""

    @classmethod
    def setUpClass(cls):
        cls.regions = student.find_regions(student.TOOL_SOURCE, "11")

    def test_the_scheduler_exercises_are_graded_without_the_engine(self):
        for ex in ("11.1", "11.2"):
            for t in self.regions[ex].tests:
                self.assertFalse(t.startswith(("Engine11", "lesson11_")), f"{ex} lists {t}")

    def test_the_engine_step_needs_the_scheduler(self):
        self.assertEqual(self.regions["11.3"].needs, ["11.1", "11.2"])


class BuildTargets(unittest.TestCase):
    def test_without_a_gpu_the_gpu_programs_are_left_out(self):
        kept, unbuilt = student.targets_to_build(["test_15_x", "test_15_x_gpu"], [region("15.1", ["A"])], False)
        self.assertEqual(kept, ["test_15_x"])
        self.assertEqual(unbuilt, {"test_15_x_gpu"})

    def test_gpu_only_regions_without_a_gpu_build_the_lesson_library(self):
        # Every test of lesson 15's regions is a GPU test: cmake must still get a target (the lesson's library,
        # so the student's code compiles), never an empty --target list.
        regions = [region("15.1", ["HopperGpu.A"]), region("15.2", ["HopperGpu.B"])]
        kept, unbuilt = student.targets_to_build(["test_15_hopper_gpu"], regions, False)
        self.assertEqual(kept, ["tvllm_l15"])
        self.assertEqual(unbuilt, {"test_15_hopper_gpu"})

    def test_with_a_gpu_everything_is_built(self):
        kept, unbuilt = student.targets_to_build(["test_15_hopper_gpu"], [region("15.1", ["A"])], True)
        self.assertEqual(kept, ["test_15_hopper_gpu"])
        self.assertEqual(unbuilt, set())


if __name__ == "__main__":
    unittest.main()
