"""Every ``zero.<name>`` the README writes in code resolves after a plain ``import zero``
(its LoggingBackend example once raised AttributeError: the submodule was never imported)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_zero_name_in_the_readme_resolves_after_import_zero():
    text = open(os.path.join(ROOT, "README.md")).read()
    fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
    code = " ".join(fenced + inline)
    names = sorted(set(re.findall(r"(?<![\w.])zero(?:\.[A-Za-z_]\w*)+", code)))
    assert len(names) > 10, names
    probe = ("import functools, zero\n"
             f"bad = [n for n in {names!r} if not functools.reduce("
             "lambda o, a: getattr(o, a, None), n.split('.')[1:], zero)]\n"
             "print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
