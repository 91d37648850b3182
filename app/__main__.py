from kvchat.app.cli import entry

entry()
