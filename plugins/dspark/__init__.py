"""DSpark: confidence-scheduled speculative decoding (the ``dspark`` feature plugin)."""
