"""The CLI's thread pools wait passively (sparseinfer/threads.py)."""

from __future__ import annotations

import subprocess
import sys


def _env_after_main(env_policy: str | None) -> str:
    code = ("import os\nfrom sparseinfer.cli import main\nmain(['run', '-p', ''])\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy:
        env["OMP_WAIT_POLICY"] = env_policy
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_cli_sets_passive_wait_before_torch_starts():
    assert _env_after_main(None) == "PASSIVE"


def test_a_policy_in_the_environment_wins():
    assert _env_after_main("ACTIVE") == "ACTIVE"


def test_default_threads_are_the_usable_cores():
    import os

    from sparseinfer.threads import default_threads

    assert 1 <= default_threads() <= (os.cpu_count() or 1)
