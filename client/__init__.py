"""Client side: SDK over tritonclient, load generator, result tables."""
