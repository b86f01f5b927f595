"""Build the fused CPU kernel ahead of time: ``python -m normfold.ops.build``.

Exits 0 either way (normfold falls back to the reference without a compiler) and says which.
"""
from __future__ import annotations

import sys

from . import _cpu


def main() -> int:
    module = _cpu.load(verbose="-v" in sys.argv)
    if module is None:
        print(f"normfold: fused CPU kernel NOT built ({_cpu.build_error()}); the reference will be used")
    else:
        print(f"normfold: fused CPU kernel ready in {_cpu.build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
