"""models/demos."""
