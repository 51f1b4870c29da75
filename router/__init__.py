"""The router: pure exit/dispatch policy and the Triton Python-backend router model."""
