"""areno.models."""
