"""FSDP2 workers: the policy, the reference policy, the value model and the reward model (and
a distillation student with its teacher).

Batches follow the layout documented in hflow/layout.py.
"""
from hflow.workers.actor import Actor, ActorConfig, Reference
from hflow.workers.base import check_batch_sizes, is_on_policy, rollout_log_probs_exact, trainable_prompts
from hflow.workers.critic import Critic, CriticConfig
from hflow.workers.fsdp import FSDPConfig
from hflow.workers.optim import OptimConfig
from hflow.workers.reward import RewardModel, RewardModelConfig
from hflow.workers.rollout_batches import RolloutConfig, split_greedy
from hflow.workers.teacher import StudentWithTeacher

__all__ = ["Actor", "ActorConfig", "Reference", "Critic", "CriticConfig", "RewardModel",
           "RewardModelConfig", "RolloutConfig", "FSDPConfig", "OptimConfig", "check_batch_sizes",
           "is_on_policy", "rollout_log_probs_exact", "split_greedy", "trainable_prompts", "StudentWithTeacher"]
