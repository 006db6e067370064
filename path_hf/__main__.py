# Copyright 2026 The path-hf authors. Apache-2.0.
"""`python -m path_hf ...`, the same as `path-hf ...`."""

import sys

from .cli import main

sys.exit(main())
