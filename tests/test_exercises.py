"""notes/exercises/: every check must pass on its solution and fail on the untouched starting
file (else it checks nothing), and every starting file must be its road step plus a TODO.
"""

import ast
import glob
import os
import re
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "..", "notes", "exercises")
sys.path.insert(0, HERE)
import check  # noqa: E402  (notes/exercises/check.py)

EXERCISES = {int(os.path.basename(p)[0]): p
             for p in sorted(glob.glob(os.path.join(HERE, "[0-9]_*.py")))}

# What the check says about each untouched starting file: the property it looks for.
FAILS_WITH = {
    1: "gradient shard lives in a storage of",
    2: "'all_gather root backward'",
    3: "two ahead means 2",
    4: "nothing overlapped with it",
}

ROAD_STEP = {1: "2_zero1", 2: "4_zero3", 3: "5_prefetch", 4: "5_prefetch"}


@pytest.fixture(scope="module")
def verdicts():
    paths = {}
    for number, start in EXERCISES.items():
        solution = os.path.join(HERE, "solutions", os.path.basename(start))
        paths[f"{number} start"] = (number, start)
        paths[f"{number} solution"] = (number, solution)
    return check.verdicts(paths)  # one group of ranks for all of them


def test_there_are_four_exercises_each_with_a_solution():
    assert sorted(EXERCISES) == sorted(check.CHECKS) == sorted(FAILS_WITH) == [1, 2, 3, 4]
    for start in EXERCISES.values():
        assert os.path.exists(os.path.join(HERE, "solutions", os.path.basename(start)))


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_the_check_passes_on_the_solution(verdicts, number):
    assert verdicts[f"{number} solution"] == []


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_the_check_fails_on_the_starting_file(verdicts, number):
    wrong = verdicts[f"{number} start"]
    assert wrong, "the check passes before the exercise is done: it checks nothing"
    assert any(FAILS_WITH[number] in w for w in wrong), wrong
    assert not any("same bits" in w for w in wrong), "a starting file trains like DDP"


def code(path: str) -> list[str]:
    """The file's lines without its docstring, its main block, and TODO comments."""
    text = open(path).read()
    body = ast.parse(text).body
    lines = text.splitlines()[body[0].end_lineno:]  # after the module docstring
    lines = lines[: next((i for i, s in enumerate(lines) if s.startswith("if __name__")), None)]
    out, in_todo = [], False
    for line in lines:
        in_todo = "# TODO" in line or (in_todo and line.strip().startswith("#"))
        if not in_todo:
            out.append(line)
    return [s for s in out if s.strip()]


@pytest.mark.parametrize("number", [1, 2, 3, 4])
def test_a_starting_file_is_its_road_step_with_a_todo(number):
    road = os.path.join(HERE, "..", "road", f"{ROAD_STEP[number]}.py")
    assert code(EXERCISES[number]) == code(road)
    assert re.search(rf"# TODO \(exercise {number}\)", open(EXERCISES[number]).read())
