"""Model description, checkpoint loading and the forward pass."""
