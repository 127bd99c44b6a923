"""`python -m lmserve` runs the command-line interface.

The guard matters: vLLM starts its engine processes with `spawn`, which imports this module again in each child.
"""

from lmserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
