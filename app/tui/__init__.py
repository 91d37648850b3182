"""The chat: the Textual App (app.py), its screens, widgets, actions and turn state."""
