"""models/environments."""
