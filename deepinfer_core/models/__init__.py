"""DeepSeek models (V2, V2-Lite, V3) and their HF-format loader."""
