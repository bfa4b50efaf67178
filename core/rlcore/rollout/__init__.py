"""The rollout side: prompts become scored trajectories, grouped per prompt, for the learner.

``colocated``: the engine shares the actor's workers and devices (the hybrid engine's mode switch, queue depth 0);
``groups``: the filter on the stream of groups (dynamic sampling)."""
