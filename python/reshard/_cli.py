"""The `reshard` console script: runs the CLI binary installed inside this package
(reshard/bin/reshard, built from csrc/cli) with the same arguments, exit code and streams.

The binary finds the model presets next to itself (reshard/configs/models); see docs/cli.md.
"""

from __future__ import annotations

import os
import sys


def binary_path() -> str:
    """Path of the installed CLI binary: bin/reshard beside the installed extension (in an editable
    install the Python sources stay in the checkout and the built files in site-packages). Raises
    FileNotFoundError naming the path when the package was installed without it (a source checkout
    used through PYTHONPATH has none: use build/bin/reshard)."""
    import importlib.util
    spec = importlib.util.find_spec("reshard._C")
    base = os.path.dirname(spec.origin) if spec is not None and spec.origin else os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(base, "bin", "reshard")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reshard CLI binary not found at {path}: install the package with "
                                "`pip install --no-build-isolation .`")
    return path


def main() -> None:
    """Replaces this process with the CLI binary (os.execv), so signals and the exit code are the CLI's."""
    try:
        path = binary_path()
    except FileNotFoundError as e:
        print(f"reshard: {e}", file=sys.stderr)
        sys.exit(2)
    os.execv(path, ["reshard"] + sys.argv[1:])


if __name__ == "__main__":
    main()
