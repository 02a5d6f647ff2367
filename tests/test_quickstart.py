"""The README's quick start, as a new user runs it: a clean clone of this repository's
HEAD, a fresh virtual environment, nothing installed but what the command installs, and
the command exactly as the README writes it. Slow (it installs torch): deselect with
`-m "not quickstart"` while iterating."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

from subprocess_helpers import REPO

pytestmark = pytest.mark.quickstart


def quick_start_command() -> str:
    """The first command of the README's "Quick start" section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    return re.search(r"```\n(.*?)\n```", section, re.S).group(1).strip()


def test_readme_quick_start_command_in_a_fresh_clone(tmp_path: pathlib.Path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    command = quick_start_command()
    assert command.startswith("python3 -m venv .venv"), command
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    # The user's PATH (without any virtual environment of ours) and where this machine's
    # packages come from; nothing else of the test's environment.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and not p.startswith(str(REPO)) and p != os.environ.get("VIRTUAL_ENV"))
    environment = {"PATH": path or "/usr/local/bin:/usr/bin:/bin"}
    for name in ("HOME", "PIP_CONFIG_FILE", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
                 "SSL_CERT_FILE", "PYENV_ROOT"):
        if os.environ.get(name):
            environment[name] = os.environ[name]
    proc = subprocess.run(["bash", "-c", command], cwd=clone, env=environment,
                          capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout
    assert "bitwise reproducible: True" in out, out
    assert re.search(r"compiled MLP: [1-9]\d* GEMMs routed to the kernel forward", out), out
