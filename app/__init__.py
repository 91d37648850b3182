"""kvchat's faces and the services they share.

    app/main.py     `kvchat`: parses the command line and hands it to one face
    app/cli/        the command line: one module per command (generate, inspect, ...)
    app/tui/        the chat: the Textual App, screens, widgets, actions, turn state
    app/serve/      `kvchat serve`: the OpenAI-compatible API
    app/core/       services every face uses: the engine, store, settings, discovery,
                    hub download, BLAS, hosts, text safety, error lines

Imports point one way: main -> faces (cli, tui, serve) -> core -> kvchat.model ->
kvchat.metal_kernels. No face imports another face; core imports no face; model never
imports app. tests/test_layout.py walks every import and fails on a cycle or on an
import against this direction.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)
