"""Deployment: starting and stopping tritonserver (embedded wheel or a system install)."""
