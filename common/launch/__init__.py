"""The `pdserve` command: its subcommands, the launcher that starts every role as a process, offline generation."""
