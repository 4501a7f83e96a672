"""cachesmith inside other serving engines: `vllm_connector`, a vLLM v1 KV connector."""
