from kvchat.app.main import entry

entry()
