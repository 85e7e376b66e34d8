"""Engine tier: the model, engine and scheduler loop in-process, against transformers."""
