"""Disk offload's files meet what a job meets: a full disk, a flipped bit, a killed rank.

What must hold (zero/features/disk_files.py): a write the disk cuts short raises at that step, naming
the disk, with the state kept in memory (and training goes on bitwise once there is room); a
file changed on disk is a named error at the next read, never a step on wrong moments; SIGTERM
removes the directory only where the process then dies of it (a program's own handler, one
installed later, or SIG_IGN keep it, and the program can still save); after SIGKILL the next
store made in the same directory reclaims it, and a reclaim never touches a directory whose
owner is alive (in another PID namespace too: a lock, not a pid) nor is held up or hurt by a
planted mark.
"""

import os
import random
import socket
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zero
from compare import GPT
from harness import run_ranks
from zero.features.disk_files import MARK, PREFIX, StateFileError, StateFiles
from zerolab.models import GPTConfig


def _loop(rank, n, directory, limit_at=None, limit=20000):
    """Three steps of a small GPT at stage 3; a file-size limit during step ``limit_at``."""
    import resource

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    offload = zero.DiskOffload(os.path.join(directory, f"r{rank}")) if directory else \
        zero.CPUOffload()
    for unit in model.units():
        zero.shard(unit, stage=3, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    error, in_memory = None, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for s in range(3):
        x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
        model.loss(model(x), y).backward()
        if s == limit_at:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write, not a dead process
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            opt.step()
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
            in_memory = sum(len(st) for st in opt.state.values())
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        opt.zero_grad()
    return error, in_memory, zero.full_state_dict(model)


def test_a_full_disk_raises_at_that_step_and_keeps_the_state_in_memory(tmp_path):
    memory = run_ranks(_loop, 2, None)
    full = run_ranks(_loop, 2, str(tmp_path), 1)
    for (_, _, m), (error, in_memory, d) in zip(memory, full):
        assert error and "StateFileError" in error and "full or over a size limit" in error
        assert str(tmp_path) in error and "kept in memory" in error
        assert in_memory > 0  # the refused units' moments, in optimizer.state
        assert all(torch.equal(m[k], d[k]) for k in m)  # and the next step wrote them again


def _corrupt(rank, n, directory, how):
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    for unit in model.units():
        zero.shard(unit, stage=3, offload_policy=zero.DiskOffload(os.path.join(directory, f"r{rank}")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
        model.loss(model(x), y).backward()
        if s == 1 and rank == 0:
            store = zero.features.disk_offload.stores_of(opt)[0]
            path = sorted(os.path.join(store.root, f) for f in os.listdir(store.root)
                          if f.endswith(".state"))[0]
            _mutate(path, how, random.Random(0))
        try:
            opt.step()
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"
        opt.zero_grad()
    return "stepped"


def _mutate(path, how, rng):
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "lengthen":
        data += bytes(rng.randrange(1, 64))
    elif how == "zeros":
        data = bytearray(len(data))
    elif how == "nan":
        data = bytearray(torch.full((len(data) // 4,), float("nan")).numpy().tobytes())
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "zeros"])
def test_a_state_file_changed_on_disk_is_a_named_error(how, tmp_path):
    said = run_ranks(_corrupt, 2, str(tmp_path), how)
    assert "StateFileError" in said[0] and "Resume from a checkpoint" in said[0], said[0]
    assert said[1] == "stepped"  # (its own files were not touched)


def test_a_fuzz_of_the_files_is_never_silent(tmp_path):
    """Random flips, truncations, lengthenings, zeros and NaNs of a written file: every read
    is the bytes written, or a named error. Counts by outcome."""
    files, rng = StateFiles(str(tmp_path)), random.Random(1)
    outcomes = {"error": 0, "same bytes": 0, "silent": 0}
    for trial in range(300):
        data = torch.randn(rng.randrange(1, 2000)).numpy().tobytes()
        path = os.path.join(files.root, "unit00000.state")
        files.write(path, data)
        _mutate(path, rng.choice(["flip", "truncate", "lengthen", "zeros", "nan"]), rng)
        got = bytearray(len(data))
        try:
            files.read_into(path, got)
        except StateFileError:
            outcomes["error"] += 1
            continue
        outcomes["same bytes" if bytes(got) == data else "silent"] += 1
    assert outcomes["silent"] == 0 and outcomes["error"] >= 290, outcomes


# The children load zero/features/disk_files.py alone (it needs only the standard library):
# 0.1 s a child instead of 2 s for torch's import.
_CHILD = textwrap.dedent("""
    import importlib.util, os, signal, sys, time
    spec = importlib.util.spec_from_file_location("disk_files", sys.argv[3])
    disk_files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(disk_files)
    if sys.argv[2] == "chain":
        signal.signal(signal.SIGTERM, lambda s, f: (open(sys.argv[1] + "/user-handler-ran", "w"),
                                                     sys.exit(3)))
    files = disk_files.StateFiles(sys.argv[1])
    files.write(os.path.join(files.root, "unit00000.state"), b"x" * 4096)
    print(files.root, flush=True)
    time.sleep(60)
""")


def _child(directory, mode):
    import zero.features.disk_files as disk_files

    proc = subprocess.Popen([sys.executable, "-c", _CHILD, directory, mode, disk_files.__file__],
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_sigterm_removes_the_directory_only_when_the_process_ends(mode, tmp_path):
    """plain (SIGTERM's default action): removed, then the process dies of the signal as it
    would without zero; chain (the program's handler calls sys.exit): zero installs nothing,
    the handler runs, and the directory goes as the interpreter exits."""
    proc, root = _child(str(tmp_path), mode)
    assert os.path.isdir(root)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    assert not os.path.exists(root)
    if mode == "chain":
        assert code == 3 and os.path.exists(tmp_path / "user-handler-ran")
    else:
        assert code == -signal.SIGTERM  # died of it, as without zero


def _step(model, opt, s, rank):
    x, y = model.batch(4, torch.Generator().manual_seed(10 * s + rank))
    model.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _preempted(rank, n, directory, how):
    """A job told to stop by SIGTERM after its first step: the loop checks the flag its own
    handler set and saves (SLURM's time limit, a spot instance, Lightning's requeue), then
    trains on; or it ignores the signal. Returns the save's outcome and the weights."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=1))
    for unit in model.units():
        zero.shard(unit, stage=3, offload_policy=zero.DiskOffload(os.path.join(directory,
                                                                                f"r{rank}")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    told = []
    if how == "own handler":  # installed before zero's store is made (at the first step)
        signal.signal(signal.SIGTERM, lambda s, f: told.append(s))
    elif how == "SIG_IGN":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    saved = None
    for s in range(3):
        _step(model, opt, s, rank)
        if s == 0 and how == "handler after zero's, chaining":
            previous = signal.getsignal(signal.SIGTERM)  # zero's, installed by the first step
            signal.signal(signal.SIGTERM, lambda s, f: (told.append(s), callable(previous)
                                                        and previous(s, f)))
        if s == 0 and how is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        if told and saved is None:
            zero.save(os.path.join(directory, "ckpt"), model, opt)
            saved = "saved"
    return saved, zero.full_state_dict(model)


@pytest.mark.parametrize("how", ["own handler", "handler after zero's, chaining", "SIG_IGN"])
def test_a_program_that_handles_or_ignores_sigterm_keeps_its_state(how, tmp_path):
    """zero's handler used to delete every directory, then call the program's: zero.save
    raised FileNotFoundError ... unit00000.state, and a program ignoring SIGTERM trained on
    with its optimizer state gone (a handler installed later that called zero's on was
    killed). Now the state is there and training equals a run never signalled, bitwise."""
    quiet = run_ranks(_preempted, 2, str(tmp_path / "quiet"), None)
    told = run_ranks(_preempted, 2, str(tmp_path / "told"), how)
    for (_, q), (saved, t) in zip(quiet, told):
        assert saved == (None if how == "SIG_IGN" else "saved")
        assert q.keys() == t.keys() and all(torch.equal(q[k], t[k]) for k in q)


def test_the_next_store_reclaims_what_a_killed_process_left_and_nothing_else(tmp_path):
    proc, root = _child(str(tmp_path), "plain")
    proc.kill()  # SIGKILL: no handler runs
    proc.wait(30)
    assert os.path.isdir(root)
    foreign = tmp_path / (PREFIX + "not-ours")  # no mark: not a store's
    foreign.mkdir()
    (tmp_path / "users-file").write_text("keep")
    files = StateFiles(str(tmp_path))
    assert files.reclaimed == [root] and not os.path.exists(root)
    assert foreign.is_dir() and (tmp_path / "users-file").read_text() == "keep"


def test_a_live_owner_in_another_pid_namespace_keeps_its_directory(tmp_path):
    """Job A in another container on the same host (same host name, same directory, its own
    PID namespace): the pid in its mark names no process here. The reclaim removed A's live
    directory, and A's next step raised. A's lock on its mark says it lives, whatever its pid."""
    proc, root = _child(str(tmp_path), "plain")
    try:
        mark = os.path.join(root, MARK)
        pid, host = open(mark).read().split()
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait()  # a pid that is no process here, as A's is in B's namespace
        with open(mark, "r+") as f:  # (the same file: A's lock stays on it)
            f.write(f"{gone.pid} {host}\n")
            f.truncate()
        files = StateFiles(str(tmp_path))  # job B
        assert files.reclaimed == [] and os.path.exists(os.path.join(root, "unit00000.state"))
    finally:
        proc.kill()
        proc.wait(30)
    assert StateFiles(str(tmp_path)).reclaimed == [root]  # once A is dead, it goes


def _reclaim_in_child(directory: str) -> str:
    """``StateFiles(directory)`` in a forked child allowed 1 GiB more address space: what it
    reclaimed, its error, or "hung"."""
    import multiprocessing as mp
    import resource

    def run(writer):
        with open("/proc/self/statm") as f:  # (torch's process has mapped gigabytes already)
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))
        try:
            writer.send(repr(StateFiles(directory).reclaimed))
        except BaseException as e:  # noqa: BLE001 (what it raised is the answer)
            writer.send(f"{type(e).__name__}: {e}")
        os._exit(0)

    reader, writer = mp.get_context("fork").Pipe(duplex=False)
    proc = mp.get_context("fork").Process(target=run, args=(writer,), daemon=True)
    proc.start()
    said = reader.recv() if reader.poll(10) else "hung"
    proc.kill()
    proc.join()
    return said


@pytest.mark.parametrize("mark", ["named pipe", "link to /dev/zero", "pid 99999999999999999999",
                                  "too long", "another host"])
def test_a_planted_mark_is_skipped_without_hanging_or_raising(mark, tmp_path):
    """A named pipe as a directory's mark hung every later store (the first opt.step())
    forever; a link to /dev/zero read until memory ran out; a pid past the C range raised
    OverflowError. A mark is now opened without following links or blocking, checked to be
    a small regular file, and anything else is not ours: skipped, the directory kept."""
    planted = tmp_path / (PREFIX + "planted")
    planted.mkdir()
    path = planted / MARK
    if mark == "named pipe":
        os.mkfifo(path)
    elif mark == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif mark == "pid 99999999999999999999":
        path.write_text(f"99999999999999999999 {socket.gethostname()}\n")
    elif mark == "too long":
        path.write_text("1 " + "x" * 100000)
    else:
        path.write_text("1 some-other-host\n")
    said = _reclaim_in_child(str(tmp_path))
    assert said == "[]", said
    assert planted.is_dir() and os.path.lexists(path)
