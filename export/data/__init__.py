"""Data that installs from the package registries (no downloads at run time)."""
