"""triollm: an LLM inference engine on structured concurrency."""
