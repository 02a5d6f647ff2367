"""Running code in fresh Python processes, for the tests of the C++ stubs and of deployment:
a loaded library cannot be unloaded, and the point is what each process sees."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_python(code: str, timeout: float = 300) -> tuple[dict, str]:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line.
    Returns that object and the process's stderr."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def stubs_only(stubs: str, body: str) -> tuple[dict, str]:
    """Run `body` in a process that loaded the stubs and never imports tritonblas_ops; the
    body fills the dict `result`."""
    code = f"import json, sys, torch\ntorch.ops.load_library({stubs!r})\nresult = {{}}\n"
    code += textwrap.dedent(body)
    code += "\nassert 'tritonblas_ops' not in sys.modules\nprint(json.dumps(result))\n"
    return run_python(code)
