"""The transformer (model.py) and the readers that fill it from GGUF or safetensors (loading.py)."""
