"""transformers decoders whose attention reads and writes through kvstore's paged cache
(:mod:`kvstore.models.hf`), tiny random presets (:mod:`kvstore.models.presets`) and GGUF
chat models (:mod:`kvstore.models.chat`); the engine that runs them is ``kvstore.engine``."""
