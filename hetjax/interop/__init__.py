"""Interoperability with the HuggingFace ecosystem, at the execution layer: `hf_checkpoint` reads
safetensors weights into a run's sharded parameters, each process reading only its own slices,
and exports any checkpoint as a directory `transformers` loads; `safetensors_files` reads and
writes the safetensors format by offset. The mapping of config.json files and the named model
presets onto hetjax's model fields is JAX-free and lives in the core (`hetjax.core.hf_config`),
where the config's checks read it."""
