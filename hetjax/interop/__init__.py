"""Interoperability with the HuggingFace ecosystem: `hf_config` maps config.json files and the
named model presets onto hetjax's model fields (JAX-free); `hf_checkpoint` reads safetensors
weights into a run's sharded parameters, each process reading only its own slices, and exports
any checkpoint as a directory `transformers` loads; `safetensors_files` reads and writes the
safetensors format by offset."""
