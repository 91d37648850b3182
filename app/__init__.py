"""kvchat's terminal side: the CLI and the Textual UI."""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)
