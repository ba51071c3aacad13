"""The `pdserve` command: its subcommands, the launcher, offline generation.

The launcher starts every role as a process.
"""
