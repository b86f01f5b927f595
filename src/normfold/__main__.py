"""``python -m normfold``: the same command as ``normfold`` (useful where the script is not on PATH)."""
from normfold.cli import main

raise SystemExit(main())
