"""Prompt analysis: a request's exact prompt tokens and vLLM block hashes (chat-template render,
tokenization, block hashing), computed off the event loop."""
