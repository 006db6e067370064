# Copyright 2026 The path-hf authors. Apache-2.0.
"""The training recipes: `accelerate launch recipes/train.py --config ...` (the checkout's launch line, beside the
configs) runs `path_hf.recipes.train`."""
