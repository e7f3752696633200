#!/usr/bin/env python
"""Generate text: ``python scripts/generate.py --chat --prompt "Hello"`` (see ``--help``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diffkv_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
