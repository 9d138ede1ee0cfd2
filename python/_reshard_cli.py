"""The `reshard` console script: runs the CLI binary installed with the reshard package
(site-packages/reshard/bin/reshard, built from csrc/cli) with the same arguments, exit code and
streams. A top-level module, so that starting the CLI does not import the reshard package (and
torch with it: about 2.5 s); CMake installs it beside the package (CMakeLists.txt).

The binary finds the model presets next to itself (reshard/configs/models); see docs/cli.md.
"""

from __future__ import annotations

import os
import sys


def binary_path() -> str:
    """Path of the installed CLI binary: reshard/bin/reshard beside this module (a wheel and an
    editable install both put the built files in site-packages). Raises FileNotFoundError naming
    the path when it is not there."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reshard", "bin", "reshard")
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
