"""`python -m lmserve` runs the command-line interface."""

from lmserve.cli import main

raise SystemExit(main())
