"""Long chats saved the way the app saves them (ConversationStore into <data dir>/chats,
session.json naming the chat open last), so the real app reopens them at start."""

from __future__ import annotations

from pathlib import Path

from kvchat.app.core.store import Conversation, ConversationStore
from kvchat.app.tui.session import SessionState, save_session, session_path

MARKDOWN_REPLY = """## Step {i}: what the cache keeps

The model reads the prompt once and keeps its **keys and values**; each new token adds
one row per layer. With *grouped-query attention* fewer heads are stored.

- prefill: the whole prompt in chunks of 512
- decode: one token at a time, reusing the cache
- rotation: the oldest tokens go once the window is full

| layer kind | window | bytes per token |
|------------|--------|-----------------|
| full       | all    | 2 × heads × dim |
| sliding    | 4096   | the same        |

```python
def step(token, cache):
    logits = model(token, cache)
    return sample(logits)  # answer {i}
```

1. Read the prompt.
2. Decode until EOS.
3. Save the cache beside the chat."""
MARKDOWN_LAST_LINE = "3. Save the cache"


def short_chat(n: int, model: Path) -> Conversation:
    """n short messages, a question and an answer in turn."""
    conv = Conversation(model=str(model))
    for i in range(n):
        if i % 2 == 0:
            conv.add_message("user", f"question {i}: what happens next in the story?")
        else:
            conv.add_message("assistant", f"answer {i}: the little dog ran to the park and"
                                          " found a red ball under the old tree.")
    return conv


def markdown_chat(replies: int, model: Path) -> Conversation:
    """`replies` Markdown answers (headings, lists, a table, a code fence), each after a
    question."""
    conv = Conversation(model=str(model))
    for i in range(replies):
        conv.add_message("user", f"question {2 * i}: explain the cache, part {i}")
        conv.add_message("assistant", MARKDOWN_REPLY.format(i=2 * i + 1))
    return conv


def save_as_last_open(conv: Conversation, data_dir: Path) -> None:
    """Save `conv` under `data_dir` (KVCHAT_DATA_DIR) as the chat the app reopens."""
    store = ConversationStore(data_dir / "chats")
    try:
        store.save(conv)
        save_session(session_path(store), SessionState(last_chat=conv.id))
    finally:
        store.close()
