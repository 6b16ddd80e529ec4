"""Engine adapters: the only code that knows an engine's internals (HF Transformers, vLLM)."""
