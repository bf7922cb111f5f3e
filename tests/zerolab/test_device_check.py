"""benchmarks/device_check.py runs unattended on a GPU machine; here its code runs on the CPU."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import device_check  # noqa: E402


def test_the_device_check_runs_its_checks_on_the_cpu(capsys):
    rows = device_check.main(["--cpu-dry-run"])
    results = {name: result for name, result, _ in rows}
    assert all(v is True for k, v in results.items() if "vs" in k and "gloo" not in k), results
    assert results["zero3 fp32 vs DDP, 2 ranks, gloo on device tensors"] is True
    assert sum("peak" in str(v) for v in results.values()) == 5  # zero1-3, CPU and disk offload
    assert not any("FAILED" in str(v) for v in results.values()), results
    assert results["streams: a profiled ZeRO-3 step (CPU: no device kernels)"] is True
    profiled = [k for k in results if k.startswith("profiled step, ")]
    assert len(profiled) == 6 and all(results[k] == "CPU: no device kernels" for k in profiled)
    waits = [k for k in results if k.startswith("host waits for the device in a step, ")]
    assert len(waits) == 6 and all(results[k] == "CPU: no device to wait for" for k in waits)
    assert "check" in capsys.readouterr().out
