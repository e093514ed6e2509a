"""areno.serve."""
