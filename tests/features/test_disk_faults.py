"""Disk offload's files meet what a job meets: a full disk, a flipped bit, a killed rank.

What must hold (zero/features/disk_files.py): a write the disk cuts short raises at that step, naming
the disk, with the state kept in memory (and training goes on bitwise once there is room); a
file changed on disk is a named error at the next read, never a step on wrong moments; the
directory goes on SIGTERM (the user's handler still runs) and, after SIGKILL, the next store
made in the same directory reclaims it, touching nothing that is not its own.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import zero
from compare import GPT
from harness import run_ranks
from zero.features.disk_files import PREFIX, StateFileError, StateFiles
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


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from zero.features.disk_files import StateFiles
    if sys.argv[2] == "chain":
        signal.signal(signal.SIGTERM, lambda s, f: (open(sys.argv[1] + "/user-handler-ran", "w"),
                                                     sys.exit(3)))
    files = StateFiles(sys.argv[1])
    files.write(os.path.join(files.root, "unit00000.state"), b"x" * 4096)
    print(files.root, flush=True)
    time.sleep(60)
""")


def _child(directory, mode):
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, directory, mode],
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_sigterm_removes_the_directory_and_calls_the_users_handler(mode, tmp_path):
    proc, root = _child(str(tmp_path), mode)
    assert os.path.isdir(root)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    assert not os.path.exists(root)
    if mode == "chain":
        assert code == 3 and os.path.exists(tmp_path / "user-handler-ran")
    else:
        assert code == -signal.SIGTERM  # died of it, as without zero


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
