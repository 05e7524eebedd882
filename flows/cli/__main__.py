"""`python -m flows.cli`: the `sftflow` console script."""

from flows.cli import main

main()
