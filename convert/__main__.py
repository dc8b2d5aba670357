"""`python -m convert` runs the command line."""

from convert.cli import main

main()
