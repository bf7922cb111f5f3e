"""A type checker over zero/: the protocols of zero/api.py are what the mechanism's fields are
typed with, so what it passes a seam is checked against the seam (setup.cfg's [mypy] says how;
zero/minimal.py, the learner's file, is left as the road writes it).

mypy reads this file too (setup.cfg's ``files``): the block under ``TYPE_CHECKING`` below
gives each of zero's own objects to a variable of its protocol's type, so an object that
drifts from the seam it serves (a member renamed, a keyword the mechanism passes dropped) is
a type error here, named, before any test runs it. ``api.check`` asks the same at run time,
by signature, of what a user passes (``tests/core/test_seams.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if TYPE_CHECKING:  # (read by mypy only: never imported, never run)
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    from zero import api
    from zero.comm.backend import TorchBackend
    from zero.comm.context import CommContext
    from zero.comm.flat_collectives import FlatCollectives
    from zero.core.flat import FlatLayout
    from zero.core.param import AsIs, ShardedParam
    from zero.core.placement import Placement
    from zero.core.root import Order
    from zero.core.rows import RowsLayout
    from zero.core.schedule import Schedule
    from zero.core.unit import Unit
    from zero.core.whole import WholeLayout
    from zero.features.all_gather_extension import SubclassForm
    from zero.features.custom_collectives import CustomCollectives
    from zero.features.disk_offload import DiskOffload
    from zero.features.logging_backend import LoggingBackend
    from zero.features.offload import CPUOffload, OnDevice
    from zero.features.quantized import QuantizedWeights
    from zero.features.quantized_gradients import QuantizedGradients

    mesh: DeviceMesh
    sharded_param: ShardedParam
    subclass_param: torch.Tensor
    unit: Unit

    # Layout: a class, made by the mechanism as Layout(shapes, world_size)
    layouts: list[type[api.Layout]] = [FlatLayout, RowsLayout, WholeLayout]
    # CommPolicy: how a unit's flat buffers cross the ranks
    comm_policies: list[api.CommPolicy] = [
        FlatCollectives(), QuantizedWeights(), QuantizedGradients(mesh), CustomCollectives()]
    # OffloadPolicy: where the shards live
    offload_policies: list[api.OffloadPolicy] = [OnDevice(), CPUOffload(), DiskOffload("d")]
    # Schedule: which units are gathered ahead of need
    schedules: list[api.Schedule] = [Schedule(prefetch=2)]
    # Backend: the collectives themselves
    backends: list[api.Backend] = [TorchBackend(), LoggingBackend("log")]
    # ParamForm: what the module computes with for one parameter
    forms: list[api.ParamForm] = [
        AsIs(), Placement(torch.Size([4]), 2),
        SubclassForm(sharded_param, subclass_param, None)]
    # SendingForm: a form that decides what its parameter sends (FSDP2's all-gather extension)
    sending_forms: list[api.SendingForm] = [SubclassForm(sharded_param, subclass_param, None)]
    # Comm: what a comm policy is handed (the root's CommContext); what a schedule is handed
    comm: api.Comm = CommContext()
    unit_view: api.UnitView = unit
    order: api.Order = Order([unit])


def test_mypy_passes_over_zero(tmp_path):
    pytest.importorskip("mypy")  # (in the test extra: pip install -e ".[test]")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_read_only_member_of_a_protocol_is_checked_at_run_time_too():
    """``on_device`` is a property in ``OffloadPolicy`` (so a class attribute, an instance's or
    a property all fit it, for mypy): ``api.check`` still asks for it, as for any member."""
    import contextlib

    from zero import api

    class Offload:  # every member of OffloadPolicy but on_device
        def home(self, compute): return compute
        def pinned(self, compute): return False
        def check(self, layout): pass
        def to_device(self, shard, device, unit, phase): return shard
        def to_host(self, shard, unit, keep=False): return shard
        def before_step(self, optimizer, units, args, kwargs): return None
        def after_step(self, optimizer, units): pass
        def resident(self, optimizer, units): return contextlib.nullcontext()

    with pytest.raises(TypeError, match="it lacks 'on_device'"):
        api.check(Offload(), api.OffloadPolicy, "offload_policy")
    Offload.on_device = True  # type: ignore[attr-defined]
    api.check(Offload(), api.OffloadPolicy, "offload_policy")
