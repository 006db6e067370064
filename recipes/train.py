# Copyright 2026 The path-hf authors. Apache-2.0.
"""The recipe's launch line, as in accelerate's and peft's examples: the run itself is `path_hf.recipes.train`.

accelerate launch recipes/train.py --config recipes/configs/tiny-cpu.yaml [section.key=value ...]
"""

import sys

from path_hf.recipes.train import follow_launcher, main

if __name__ == "__main__":
    follow_launcher()
    sys.exit(main())
