"""``python -m normfold.train`` (also under ``torchrun``)."""
import sys

from .cli import main

sys.exit(main())
