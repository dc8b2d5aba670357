#!/usr/bin/env python3
"""`python cli.py gqa2mla ...` from a checkout: the same command as the `convert` entry point."""

from convert.cli import main

if __name__ == "__main__":
    main()
