"""Training forwards: the forward config, prefix-shared and packed forwards, packing and routes."""
