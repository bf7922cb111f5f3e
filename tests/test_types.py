"""A type checker over zero/: the protocols of zero/api.py are what the mechanism's fields are
typed with, so what it passes a seam is checked against the seam (setup.cfg's [mypy] says how;
zero/minimal.py, the learner's file, is left as the road writes it)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_passes_over_zero(tmp_path):
    pytest.importorskip("mypy")  # (in the test extra: pip install -e ".[test]")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
