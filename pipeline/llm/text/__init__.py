"""Text: tokenizers, chat templates, prompts, tool calls, grammars and structured output, UTF-8-safe streams."""
