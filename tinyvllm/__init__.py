"""tinyvllm: a small, fast, readable LLM inference engine."""
