"""Training the built-in model."""
