"""Text in and out of the model: the tokenizer (SentencePiece and Hugging Face
`tokenizers`, streaming detokenizer) and the sandboxed chat-template renderer."""
