"""models/training."""
