"""hflow.recipe_kit: what every recipe in recipes/ does the same way.

`set_up` (the set-up every recipe calls, old log-probs, the KL to the reference, the figures
every step logs), `run` (a run's bookkeeping: steps, resume, cadences), `config` (the config
groups in one import), `text_batches` (prompt rows -> Batches, responses -> text), `scoring`
(a rollout's training score), `evaluation` (held-out evaluation), `async_rollouts` (generation
ahead of training), `critic_free` (the critic-free family's flags and loss).
"""
