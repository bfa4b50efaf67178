"""The hybrid engine: actor and rollout engine share devices; weights move train -> rollout every step."""
