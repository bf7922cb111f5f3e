"""notes/exercises/: every check must pass on its solution, fail on the untouched starting
file (else it checks nothing) and say what is wrong with the wrong attempts a learner makes;
every starting file must be its road step plus a TODO that does not give the answer away.
"""

import ast
import glob
import os
import re
import sys

import pytest

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "notes", "exercises")
sys.path.insert(0, HERE)
import check  # noqa: E402  (notes/exercises/check.py)

EXERCISES = {int(os.path.basename(p)[0]): p
             for p in sorted(glob.glob(os.path.join(HERE, "[0-9]_*.py")))}

# What the check says about each untouched starting file: the property it looks for.
FAILS_WITH = {
    1: "has a storage of its own",
    2: "were freed when its forward ended and gathered again",
    3: "two ahead means 2 there",
    4: "nothing overlapped with it",
    5: "5 of the 5 units hold full parameters",
}

ROAD_STEP = {1: "2_zero1", 2: "4_zero3", 3: "5_prefetch", 4: "5_prefetch", 5: "3_zero2"}
SOLVED_BY_ROAD = {5: "4_zero3"}  # a solution that is a road step

# Pieces of exercise 5's solution that its wrong attempts change.
FREE = "        self.full.untyped_storage().resize_(0)\n"  # free(): the body
GATHER_INTO = (  # gather(): where the values land
    "        if phase == \"forward\":\n"
    "            self.full = self.shard.new_empty(self.layout.padded_numel)\n"
    "        else:  # refill the storage that free() emptied\n"
    "            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())\n")
NEW_FULL = "        self.full = self.shard.new_empty(self.layout.padded_numel)\n"
GATHER_IN_BACKWARD = ("        output.register_hook(lambda grad: self.gather(\"backward\"))  # before the "
                      "unit's backward\n")

# Wrong attempts a learner makes, as edits of the solution: (old, new, what the check must say);
# an attempt of several edits gives old and new as tuples.
# Exercise 5's are the natural wrong ways to free: drop the reference, free the wrong buffer,
# free too early, never refill; each must be refused with a hint that is true of it.
WRONG = {
    1: [("full_grad[r * s : (r + 1) * s]", "full_grad[:s]",
         "rank 1: blocks.0's gradient shard lives in the full gradient, but at element 0"),
        ("full_grad[r * s : (r + 1) * s]", "full_grad[r * s : (r + 1) * s].clone()",
         "has a storage of its own")],
    2: [("        if self is self.units[-1]:\n            return  # the root: its backward comes "
         "first, and Gather.backward frees it after\n        self.free()\n",
         "        if self is not self.units[-1]:  # keep the root\n            self.free()\n",
         "the root kept its full parameters after its forward, yet its backward gathered"),
        ("        if self is self.units[-1]:\n", "        if True:  # keep every unit\n",
         "backward gathered nothing: every block must still be freed")],
    3: [("        if nxt is not None and nxt.pending is None:", "        if nxt is not None:",
         "forward gathered a unit twice"),
        ("            after.gather(phase)  # the second prefetch: two units ahead\n",
         "            after.gather(phase)  # the second prefetch: two units ahead\n"
         "        third = after.next.get(phase) if after is not None else None\n"
         "        if third is not None and third.pending is None:\n"
         "            third.gather(phase)\n",
         "as blocks.0 starts its forward, 3 later block(s) are being gathered"),
        ("            after.gather(phase)  # the second prefetch: two units ahead\n",
         "            after.gather(phase)  # the second prefetch: two units ahead\n"
         "            third = after.next.get(phase)  # (only when `after` was not yet on its way)\n"
         "            if third is not None and third.pending is None:\n"
         "                third.gather(phase)\n",
         "as the root starts its forward, 3 block(s) are being gathered")],
    4: [("        for unit in ctx.unit.units:\n            unit.wait_reduce()",
         "        if False:\n            pass",
         "a reduce-scatter was never waited for before backward ended"),
        ("        for unit in ctx.unit.units:\n"
         "            unit.wait_reduce()  # at most one in flight: finish the previous one first\n"
         "        ctx.unit.reduce(full_grad)\n"
         "        if ctx.unit is ctx.unit.units[-1]:\n"
         "            ctx.unit.wait_reduce()",
         "        ctx.unit.reduce(full_grad)\n"
         "        if ctx.unit is ctx.unit.units[-1]:  # wait for all, at the end\n"
         "            for unit in ctx.unit.units:\n"
         "                unit.wait_reduce()",
         "5 reduce-scatters were in flight at once; keep at most one"),
        ("        ctx.unit.reduce(full_grad)\n",
         "        ctx.unit.reduce(full_grad)\n        ctx.unit.wait_reduce()\n",
         "nothing overlapped with it")],
    5: [("comm.all_gather(self.full.data,", "comm.all_gather(self.full,",
         "autograd saw the refill of a tensor whose views it uses"),
        ("        ctx.unit.free()  # backward is done with the unit's parameters\n", "",
         "bytes of full parameters are left after the step: free each unit again"),
        # never refill: the gather in backward goes into a new tensor, not the freed one
        ("        else:  # refill the storage that free() emptied\n",
         "        if True:  # a new tensor\n"
         "            self.full = self.shard.new_empty(self.layout.padded_numel)\n"
         "        else:\n",
         "something computed with a tensor whose storage was freed (0 bytes) and not filled again"),
        # never refill: nothing gathers in backward
        (GATHER_IN_BACKWARD, "",
         "something computed with a tensor whose storage was freed (0 bytes) and not filled again"),
        # free too early: as soon as the modules have their views, before they compute
        ("            setattr(mod, attr, views[i])  # the module computes with views of the full buffer\n",
         "            setattr(mod, attr, views[i])  # the module computes with views of the full buffer\n"
         "        self.free()\n",
         "something computed with a tensor whose storage was freed (0 bytes) and not filled again"),
        # free the wrong buffer: the shard, which this rank keeps and the optimizer steps
        (FREE, "        self.shard.untyped_storage().resize_(0)\n",
         "blocks.0's shard, the slice this rank owns and the optimizer steps, has 0 bytes left"),
        # drop the reference: a name goes, the bytes stay (the views hold the storage); training
        # is bitwise, and an earlier check counted ``unit.full``, not the bytes, and passed it
        ((FREE, GATHER_INTO), ("        self.full = None\n", NEW_FULL),
         "blocks.0's full parameters are still alive (50816 bytes) though the unit no longer "
         "names them: dropping a reference frees no byte"),
        # drop every reference: the modules' views too; autograd's saved ones still hold it
        ((FREE, GATHER_INTO), ("        self.full = None\n        for mod, attr, i in self.uses:\n"
                                "            setattr(mod, attr, None)\n", NEW_FULL),
         "blocks.0's full parameters are still alive (50816 bytes) though the unit no longer "
         "names them")],
}

# Right answers other than the solution, as edits of it: (old, new, where a page says so).
# Exercise 5's question 3 asks what can run code when backward reaches a unit: a module
# backward pre-hook runs at the moment the solution's tensor hook on the output does.
ACCEPTED = {
    5: [("        output.register_hook(lambda grad: self.gather(\"backward\"))  # before the unit's backward\n",
         "",
         "        module.register_forward_hook(self.post_forward)\n",
         "        module.register_forward_hook(self.post_forward)\n"
         "        module.register_full_backward_pre_hook(lambda m, grad: self.gather(\"backward\"))\n",
         "If your exercise 5 gathered in a module backward pre-hook "
         "(`module.register_full_backward_pre_hook`) instead of a hook on the output tensor, it is "
         "right too, and the check accepts it")],
}


NUMBERS = [1, 2, 3, 4, 5]


def edited(text: str, old: str | tuple, new: str | tuple) -> str:
    """``text`` with each ``old`` (found exactly once) replaced by its ``new``."""
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        assert text.count(o) == 1, o
        text = text.replace(o, n)
    return text


def solution(number: int) -> str:
    return os.path.join(HERE, "solutions", os.path.basename(EXERCISES[number]))


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    paths, tmp = {}, tmp_path_factory.mktemp("wrong")
    for number, start in EXERCISES.items():
        paths[f"{number} start"] = (number, start)
        paths[f"{number} solution"] = (number, solution(number))
        text = open(solution(number)).read()
        for k, (old, new, _) in enumerate(WRONG[number]):
            attempt = tmp / f"{number}_wrong_{k}.py"
            attempt.write_text(edited(text, old, new))
            paths[f"{number} wrong {k}"] = (number, str(attempt))
        for k, (old1, new1, old2, new2, _) in enumerate(ACCEPTED.get(number, [])):
            assert text.count(old1) == 1 and text.count(old2) == 1, (number, old1, old2)
            attempt = tmp / f"{number}_accepted_{k}.py"
            attempt.write_text(text.replace(old1, new1).replace(old2, new2))
            paths[f"{number} accepted {k}"] = (number, str(attempt))
    with pytest.MonkeyPatch.context() as env:  # as a learner runs the check: without check
        env.setenv("ZERO_CHECK", "0")  # mode, whose agreements would double the collectives
        return check.verdicts(paths)  # one group of ranks for all of them


def test_there_are_five_exercises_each_with_a_solution():
    assert sorted(EXERCISES) == sorted(check.CHECKS) == sorted(FAILS_WITH) == NUMBERS
    for number in EXERCISES:
        assert os.path.exists(solution(number))


@pytest.mark.parametrize("number", NUMBERS)
def test_the_check_passes_on_the_solution(verdicts, number):
    assert verdicts[f"{number} solution"] == []


@pytest.mark.parametrize("number", NUMBERS)
def test_the_check_fails_on_the_starting_file(verdicts, number):
    wrong = verdicts[f"{number} start"]
    assert wrong, "the check passes before the exercise is done: it checks nothing"
    assert any(FAILS_WITH[number] in w for w in wrong), wrong
    assert not any("same bits" in w for w in wrong), "a starting file trains like DDP"


@pytest.mark.parametrize("number", NUMBERS)
def test_the_check_says_what_a_wrong_attempt_got_wrong(verdicts, number):
    for k, (_, _, said) in enumerate(WRONG[number]):
        wrong = verdicts[f"{number} wrong {k}"]
        assert any(said in w for w in wrong), (k, wrong)


@pytest.mark.parametrize("number", sorted(ACCEPTED))
def test_the_check_passes_another_right_answer_and_a_page_says_so(verdicts, number):
    """A right answer the solution does not give passes too, and the page a learner reads
    after the exercise (the road's folded steps 4 and 5) says that it does, and why the
    solution is written the other way."""
    road = " ".join(open(os.path.join(HERE, "..", "road", "README.md")).read().split())
    for k, (*_, said) in enumerate(ACCEPTED[number]):
        assert verdicts[f"{number} accepted {k}"] == []
        assert said in road[road.index("<details>"):], said


@pytest.mark.parametrize("number", NUMBERS)
def test_no_todo_or_message_gives_the_answer_away(number):
    """The solution's new lines appear in neither the starting file nor the check's messages."""
    bare = lambda lines: {s.split("  #")[0].strip() for s in lines}  # noqa: E731
    start, solved = bare(code(EXERCISES[number])), bare(code(solution(number)))
    new = [s for s in solved - start if len(s) > 12]
    assert new, number
    told = open(EXERCISES[number]).read() + open(os.path.join(HERE, "check.py")).read()
    assert not [s for s in new if s in told], number


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


@pytest.mark.parametrize("number", NUMBERS)
def test_a_starting_file_is_its_road_step_with_a_todo(number):
    road = os.path.join(HERE, "..", "road", f"{ROAD_STEP[number]}.py")
    assert code(EXERCISES[number]) == code(road)
    assert re.search(rf"# TODO \(exercise {number}\)", open(EXERCISES[number]).read())
    if number in SOLVED_BY_ROAD:
        road = os.path.join(HERE, "..", "road", f"{SOLVED_BY_ROAD[number]}.py")
        assert code(solution(number)) == code(road)


def test_the_predictions_are_the_traces_answers():
    """notes/exercises/solutions/predict.md answers from the committed traces (which
    tests/zerolab/test_trace.py holds to a fresh run): each number there is read here from them."""
    figures = os.path.join(HERE, "..", "figures")
    trace = {k: open(os.path.join(figures, f"trace_stage{k}.txt")).read() for k in (1, 2, 3)}
    answers = " ".join(open(os.path.join(HERE, "solutions", "predict.md")).read().split())

    def held(stage, unit, event, column):  # bytes after the first matching event
        row = re.search(rf"^ *[\d.]+  {re.escape(unit)} +{re.escape(event)}.*?(\d+) +(\d+)  \S",
                        trace[stage], re.M)
        return int(row.group(column))

    gathers, reduces = (int(re.search(rf"(\d+) {op}s \d+ B", trace[3]).group(1))
                        for op in ("all-gather", "reduce-scatter"))
    assert f"ZeRO-3 issues {gathers} all-gathers and {reduces} reduce-scatters" in answers
    sent = re.search(r"= ([\d.]+) R", trace[3]).group(1)
    assert f"ZeRO-3 sends {sent}R" in answers
    assert all("= 2.000 R" in trace[k] for k in (1, 2)) and "ZeRO-2 send 2.000R" in answers
    assert f"holds {held(3, 'root', 'post_backward', 2)} gradient bytes" in answers
    done = {k: held(k, "", "autograd is done", 2) for k in (1, 2)}
    assert f"ZeRO-1 holds {done[1]} gradient bytes, ZeRO-2 {done[2]}" in answers
    assert f"holds {held(3, 'blocks.0', 'pre_forward', 1)} parameter bytes" in answers


def test_the_harness_counts_the_bytes_alive_not_a_name():
    """notes/road/common.py's ``Alive``: a unit holds the bytes of every storage its modules
    computed with for as long as anything keeps it, whatever ``unit.full`` says (issue 50: a
    check that read ``unit.full`` passed a ZeRO-3 that dropped the name and freed nothing)."""
    import types

    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "road"))
    import common

    module, full = torch.nn.Module(), torch.zeros(16)
    module.weight = full[:8].view(2, 4)  # what a unit's pre_forward hands its module
    unit = types.SimpleNamespace(name="blocks.0", uses=[(module, "weight", 0)], full=full,
                                 shard=torch.nn.Parameter(torch.zeros(8)))
    alive = common.Alive([unit])
    assert alive.full(unit) == 64 and alive.lost() == {}
    saved = module.weight  # as autograd saves it for backward
    unit.full, module.weight = None, None  # every name dropped: the bytes stay with the view
    del full
    assert alive.full(unit) == 64 and alive.lost() == {"blocks.0": 64}
    assert alive.held() == (64 + 32, 0)  # and the shard
    saved.untyped_storage().resize_(0)  # freed: the view stays valid, its bytes are gone
    assert alive.full(unit) == 0 and alive.lost() == {}
    del saved  # and gone altogether: nothing is left to count
    assert alive.storages(unit) == {}
