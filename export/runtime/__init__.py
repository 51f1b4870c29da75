"""Bodies of the Python-backend models that run splits and baselines inside Triton."""
