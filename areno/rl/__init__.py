"""areno.rl."""
