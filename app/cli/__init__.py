"""The command line: one module per `kvchat` command (see app/main.py for the entry)."""
