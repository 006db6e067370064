# Copyright 2026 The path-hf authors. Apache-2.0.
"""`python -m lab.pe_lab`: the lab's full grid (see run.py)."""

import sys

from .run import main

sys.exit(main())
