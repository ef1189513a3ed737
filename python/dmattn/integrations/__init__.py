"""Integrations of dmattn with other libraries (imported on demand)."""
