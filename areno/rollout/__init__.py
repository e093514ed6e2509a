"""areno.rollout."""
