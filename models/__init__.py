"""Small decoder models (Llama-, Mistral-, Gemma-2- and Gemma-3-style) whose attention reads
and writes through the paged cache; the engine that runs them is ``kvstore.engine``."""
