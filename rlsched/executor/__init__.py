"""The real executor: the only part of rlsched that imports torch (install `rlsched[executor]`).

- model.py: the Llama-family transformer (Llama, Mistral, Qwen2/2.5, Qwen3) and its config
- kvcache.py: the preallocated KV cache whose rows keep their own lengths
- rope.py: rotary embeddings and the configs' scalings
- loading.py: a local HF folder (config.json, safetensors, tokenizer.json) -> model

Import the submodules explicitly; this package itself imports nothing, so that importing
`rlsched` never pulls torch in.
"""
