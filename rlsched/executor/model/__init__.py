"""The target and drafter models: the Llama-family transformer, its KV cache and rotary
embeddings, loading and saving HF folders, compiled forwards, and the built-in tiny pair."""
