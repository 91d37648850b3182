"""Text in and out of the model: the tokenizer (SentencePiece and Hugging Face
`tokenizers`, streaming detokenizer), the sandboxed chat-template renderer, and the
tool-call formats families write."""
