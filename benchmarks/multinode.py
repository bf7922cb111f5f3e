"""A real multi-node launch on one machine: two torchrun launchers, each a "node" of 2 ranks,
meet through the c10d rendezvous on localhost, and train exactly as one launcher of 4 ranks.

    python benchmarks/multinode.py        # two launchers, then one; the losses, bitwise

Why: everything else in the project starts its ranks itself (forked, a FileStore). A cluster
starts them with one torchrun per node, and the ranks of one node know nothing of the other's
but the rendezvous address. This script is that launch, short of a second machine: two
launchers (`--nnodes 2 --nproc-per-node 2`, c10d rendezvous on localhost:<a free port>), then a
one-launcher run of the same 4 ranks (`--nnodes 1 --nproc-per-node 4 --standalone`). The
training depends only on the global rank (zerolab.systems.System.step's data), never on the
node a rank landed on, so the two runs' losses must be equal bit for bit, system by system.

The launcher role (the default) starts the runs, each torchrun in a session of its own, with
a timeout; if one fails, every process it started is killed and its stderr printed. Each run's
rank 0 writes every rank's losses to a JSON file in a temporary directory (a float's JSON
text is its repr, which reads back to the same double); the launcher prints a table and
exits 1 if any system's losses differ.

The worker role (`--worker`, run by torchrun) is the stage comparison itself: it calls
benchmarks/compare_stages.py's `compare` (each system's `measure`: the same model, data,
memory tracker and byte counter as `torchrun ... compare_stages.py`) rather than starting
compare_stages.py, so that the losses come back as data and not as a results file. Then it
trains HSDP, ours and FSDP2's, on a 2-D mesh of (nodes, ranks per node): 2 x 2 here, and
the one-launcher run is given the same mesh (its own would be 1 x 4). compare_stages.py
itself also runs unchanged under two launchers (its --world-size is then torchrun's), as
the README's two commands for two real nodes do.

c10d numbers the nodes itself, in the order of the launchers' (host, pid), not by
`--node-rank` (torchrun ignores it for c10d, with a warning), so it is not passed; which
launcher holds global ranks 0-1 does not change what rank r computes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from argtypes import comma_list, int_in, positive_int  # noqa: E402

HSDP_KINDS = ("zero3", "fsdp2")  # ours and FSDP2's, on the (nodes, ranks per node) mesh
NODES, RANKS_PER_NODE = 2, 2
LAYERS, DIM, SEQ, BATCH, STEPS = 2, 32, 16, 2, 3  # a tiny GPT: the launch is what is tested
TIMEOUT_S = 300  # per run; a rendezvous that never completes waits torchrun's 900 s otherwise


# ---- launcher ------------------------------------------------------------------------------

class LaunchFailed(RuntimeError):
    """A torchrun exited non-zero or ran past its timeout; the message has its stderr."""


def free_port() -> int:
    """A port nothing listens on now: bind to port 0 and read what the kernel chose."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun(nnodes: int, nproc: int, rendezvous: list[str], out: str, args) -> list[str]:
    """The command line of one launcher running this script's worker role."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), *rendezvous, os.path.abspath(__file__), "--worker",
            "--out", out, *worker_argv(args)]


def worker_argv(args) -> list[str]:
    return ["--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq),
            "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device,
            "--systems", ",".join(args.systems), "--mesh", f"{args.nodes},{args.nproc_per_node}"]


def run_launchers(commands: list[list[str]], logs: str, timeout: float) -> None:
    """Start every command at once, each in a session of its own (torchrun and its workers:
    one process group to kill), and wait for all of them. On a failure or the timeout, kill
    every group still running and raise with the failed launchers' stderr."""
    procs = []
    for i, cmd in enumerate(commands):
        err = open(os.path.join(logs, f"launcher{i}.err"), "w")
        procs.append((subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT,
                                       start_new_session=True), err))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p, _ in procs]  # every one, each time (any() would stop early)
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: the others would wait out the rendezvous
            time.sleep(0.2)
    finally:
        for p, err in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            err.close()
    failed = [(i, p.returncode) for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        raise LaunchFailed("\n".join(
            f"launcher {i} of {len(procs)} exited {rc} "
            f"{'(killed: timeout or another launcher failed)' if rc == -signal.SIGKILL else ''}\n"
            f"  {' '.join(commands[i])}\n{_tail(os.path.join(logs, f'launcher{i}.err'))}"
            for i, rc in failed))


def _tail(path: str, lines: int = 150) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def several_launchers(args, tmp: str) -> dict:
    """args.nodes launchers of args.nproc_per_node ranks each, meeting at localhost:<port>."""
    port, out = free_port(), os.path.join(tmp, "several.json")
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                  "--rdzv-id", f"zero-multinode-{uuid.uuid4().hex[:12]}"]
    cmd = torchrun(args.nodes, args.nproc_per_node, rendezvous, out, args)
    run_launchers([cmd] * args.nodes, _logs(tmp, "several"), args.timeout)
    return _read(out)


def one_launcher(args, tmp: str) -> dict:
    """The same ranks from one launcher (--standalone: its own rendezvous on a free port)."""
    out = os.path.join(tmp, "one.json")
    cmd = torchrun(1, args.nodes * args.nproc_per_node, ["--standalone"], out, args)
    run_launchers([cmd], _logs(tmp, "one"), args.timeout)
    return _read(out)


def _logs(tmp: str, name: str) -> str:
    os.makedirs(path := os.path.join(tmp, name), exist_ok=True)
    return path


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def compare_runs(several: dict, one: dict) -> list[tuple[str, int, float, float, bool]]:
    """(system, values, first loss, last loss, equal?) for every system of either run;
    equal means the same bits at every rank and step (a system missing from one run is not)."""
    rows = []
    for name in dict.fromkeys([*several, *one]):
        a, b = several.get(name), one.get(name)
        ref = a or b
        equal = a is not None and b is not None and _bits(a) == _bits(b)
        rows.append((name, sum(map(len, ref)), ref[0][0], ref[0][-1], equal))
    return rows


def _bits(losses: list[list[float]]) -> list[list[str]]:
    """Each double's exact bits as text (== would call -0.0 and 0.0 equal, and NaN unequal)."""
    return [[float.hex(x) for x in rank] for rank in losses]


def table(rows, args) -> str:
    head = (f"| system | (rank, step) values | rank 0 first loss | rank 0 last loss "
            f"| {args.nodes} launchers x {args.nproc_per_node} = 1 launcher x "
            f"{args.nodes * args.nproc_per_node} |")
    lines = [head, "|---|---|---|---|---|"]
    for name, n, first, last, equal in rows:
        lines.append(f"| {name} | {n} | {first:.6f} | {last:.6f} | "
                     f"{'bitwise equal' if equal else 'DIFFERENT'} |")
    return "\n".join(lines)


def check(args, forked_reference: bool = False) -> list[tuple[str, int, float, float, bool]]:
    """Both runs, compared; raises LaunchFailed if either could not run. With
    ``forked_reference`` the one-machine run is ranks forked from this process
    (zerolab/launch.py) instead of a second torchrun: the same training, seconds sooner."""
    with tempfile.TemporaryDirectory(prefix="zero-multinode-") as tmp:
        start = time.monotonic()
        several = several_launchers(args, tmp)
        middle = time.monotonic()
        one = forked(args) if forked_reference else one_launcher(args, tmp)
        print(f"{args.nodes} launchers: {middle - start:.1f}s, 1 "
              f"{'forked run' if forked_reference else 'launcher'}: "
              f"{time.monotonic() - middle:.1f}s", file=sys.stderr)
    return compare_runs(several, one)


def forked(args) -> dict:
    """The same ranks forked on this machine, each training what a torchrun worker trains."""
    from zerolab.launch import run_ranks

    n = args.nodes * args.nproc_per_node
    return run_ranks(_forked_rank, n, args, timeout=args.timeout)[0]


def _forked_rank(rank: int, n: int, args) -> dict:
    warnings.filterwarnings("ignore")
    return train(args, rank, n, local_world_size=args.nproc_per_node)


# ---- worker (under torchrun) ---------------------------------------------------------------

def worker(args) -> None:
    """Every system of the stage comparison, then HSDP on the mesh; rank 0 writes the losses."""
    import datetime

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # trackers' hook warnings, DDP's find_unused note
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = train(args, rank, n, int(os.environ["LOCAL_WORLD_SIZE"]))
    if rank == 0:
        write_json(args.out, losses)
    dist.barrier()
    dist.destroy_process_group()
    leave()


def train(args, rank: int, n: int, local_world_size: int) -> dict:
    """Every rank's losses of each system of the stage comparison, then of HSDP on the mesh
    (nodes x ranks per node, unless --mesh says otherwise)."""
    import compare_stages

    mesh = tuple(args.mesh) if args.mesh else (n // local_world_size, local_world_size)
    bench = compare_stages.parse_args([
        "--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq),
        "--batch", str(args.batch), "--systems", ",".join(args.systems), "--device", args.device,
        "--no-time"])
    bench.world_size = n
    losses = {r["kind"]: r["losses_all_ranks"] for r in compare_stages.compare(bench, rank == 0)}
    for kind in HSDP_KINDS:
        name = f"{kind} hsdp {mesh[0]}x{mesh[1]}"
        losses[name] = hsdp_losses(kind, mesh, bench, rank, args.steps)
    return losses


def leave() -> None:
    """Exit without the interpreter's teardown. About one run in twenty, under load, a rank
    aborted after destroy_process_group, in torch's C++ teardown ("terminate called without
    an active exception", no Python frame); torchrun then failed the whole run though every
    rank had finished. zerolab/launch.py ends its ranks the same way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hsdp_losses(kind: str, mesh: tuple, bench, rank: int, steps: int) -> list[list[float]]:
    """Every rank's losses of `steps` steps of HSDP (shard within a node, replicate across)."""
    import torch
    import torch.distributed as dist

    from compare_stages import make_model
    from zerolab.systems import System

    device = torch.device(bench.device, torch.cuda.current_device()) \
        if bench.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    system = System(kind, make_model(bench).to(device), "adamw", mesh_shape=mesh)
    mine = [system.step(rank, i, batch=bench.batch)[0].item() for i in range(steps)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def write_json(path: str, data) -> None:
    """Whole or not at all: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


# ---- command line --------------------------------------------------------------------------

def mesh_shape(text: str) -> tuple[int, int]:
    """'nodes,ranks': two positive integers (comma_list would refuse '2,2', a repeat)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"must be two positive integers 'nodes,ranks', got {text!r}")
    return shape


def parse_args(argv=None) -> argparse.Namespace:
    from zerolab.systems import KINDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help="the worker role (torchrun runs it)")
    p.add_argument("--out", help="worker: where rank 0 writes the losses (JSON)")
    p.add_argument("--mesh", type=mesh_shape, default=None,
                   help="worker: HSDP mesh 'nodes,ranks' (default: torchrun's nodes x local ranks)")
    p.add_argument("--nodes", type=int_in(2, 8), default=NODES, help="launchers in the first run")
    p.add_argument("--nproc-per-node", type=int_in(1, 8), default=RANKS_PER_NODE)
    p.add_argument("--layers", type=positive_int, default=LAYERS)
    p.add_argument("--dim", type=positive_int, default=DIM, help="a multiple of 4 (heads)")
    p.add_argument("--seq", type=positive_int, default=SEQ)
    p.add_argument("--batch", type=positive_int, default=BATCH, help="per rank")
    p.add_argument("--steps", type=int_in(1, 100), default=STEPS, help="HSDP steps")
    p.add_argument("--systems", type=comma_list(KINDS), default=list(KINDS),
                   help=f"comma list of {KINDS}")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--timeout", type=int_in(10, 3600), default=TIMEOUT_S, help="seconds per run")
    args = p.parse_args(argv)
    if args.worker and not args.out:
        p.error("--worker needs --out")
    if args.dim % 4:
        p.error(f"--dim must be a multiple of the number of heads (4), got {args.dim}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    try:
        rows = check(args)
    except LaunchFailed as e:
        print(e, file=sys.stderr)
        return 1
    print(table(rows, args))
    return 0 if all(equal for *_, equal in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
