"""What the CLI says to a user who may not read what a command needs: a message, not a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import corral

SRC = str(Path(corral.__file__).resolve().parent.parent)


def test_a_user_without_access_to_the_image_store_gets_a_message_and_125() -> None:
    """`corral image ls` by a user who cannot list root's image store ended in a PermissionError
    traceback (helper 138)."""
    store = Path(tempfile.mkdtemp(prefix="corral-test-images-"))
    try:
        (store / "built").mkdir(mode=0o700)
        os.chmod(store, 0o711)
        # Debian's python (the venv's may sit where nobody reaches it), with the venv's packages
        site = next(p for p in sys.path if p.endswith("site-packages") and ".venv" in p)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": f"{SRC}:{site}", "CORRAL_IMAGE_DIR": str(store)}
        denied = subprocess.run(["/usr/bin/python3", "-P", "-m", "corral.cli", "image", "ls"], capture_output=True,
                                text=True, env=env, user=65534, group=65534, extra_groups=[], cwd="/", timeout=60)
        assert denied.returncode == 125, denied
        assert "Traceback" not in denied.stderr and "Permission denied" in denied.stderr, denied
        assert str(store) in denied.stderr and "run as root" in denied.stderr, denied
        # allowed: root lists the same store
        listed = subprocess.run([sys.executable, "-m", "corral.cli", "image", "ls"], capture_output=True, text=True,
                                env={**os.environ, "CORRAL_IMAGE_DIR": str(store)}, timeout=60)
        assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed
    finally:
        shutil.rmtree(store)
