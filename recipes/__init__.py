# Copyright 2026 The path-hf authors. Apache-2.0.
"""The training recipes, installed as `path_hf.recipes`: `accelerate launch recipes/train.py --config ...`."""
