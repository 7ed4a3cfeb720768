"""The hybrid engine: the actor's training weights and its generation engine (hflow.engine) on
the same ranks.

A rollout has three steps, each a dispatched call of the Actor:

    begin   wake the engine and load the current FSDP2 weights into it through
            `reshard.generation_weights`, one tensor at a time (no second full copy of the model);
    sample  generate on those weights: any number of rounds (a multi-turn controller's);
    end     sleep: the KV cache (and, by default, the weights) are freed and given back to the
            system (parallel.release_freed_memory), so the training step never sees them.

`Actor.generate` is the three in one call. Between begin and end the actor refuses to update or
load its weights: the engine would go on sampling from the old ones.

With tp_g > 1 the engine of a tensor-parallel group (ranks t * dp_g + j for t = 0..tp_g-1,
strided) runs as one: its ranks pool the prompts they were dispatched, generate them all with
the same seeds, and each keeps the results of its own prompts. A multi-turn rollout's group is
led by one rank, which runs the group's sessions and sends every engine step's requests to the
others (workers/lockstep_engine.py).

`with_greedy` adds one greedy (temperature 0) response per prompt to the same engine call — the
baseline of ReMax — as sample n of each prompt (rollout.split_greedy separates them).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hflow.engine import LLM, SamplingParams, stop_token_ids
from hflow.engine.sequence import RequestOutput
from hflow.faults import fault_point
from hflow.distributed.parallel import device_of, local_group, make_mesh, release_freed_memory
from hflow.distributed.reshard import generation_mesh, generation_weights
from hflow.distributed.weight_sync import joint_ranks, send_weights, weight_manifest
from hflow.workers.fsdp import mixed_precision
from hflow.workers.lockstep_engine import EngineGroup
from hflow.workers.rollout_batches import RolloutConfig


class HybridEngine:
    """The generation engine of one actor rank, the generation mesh it is fed through, and
    whether a rollout is open on it (begin ... end)."""

    def __init__(self, train_mesh: DeviceMesh, model: torch.nn.Module, model_path: str, fsdp_cfg):
        self.train_mesh, self.model, self.model_path = train_mesh, model, model_path
        self.device = device_of(train_mesh)
        self.dtype = mixed_precision(fsdp_cfg, self.device).param_dtype or torch.float32
        self.llm = self.gen_mesh = None
        self.tp_size = 0
        self.full_mesh = None   # the tp-1 generation mesh the weights are pushed from (push)
        self.open_rollout: RolloutConfig | None = None
        """the config begin() was given, until end(): the engine holds the weights of that moment"""

    def _engine(self, cfg: RolloutConfig) -> LLM:
        """Build the generation mesh and the engine the first time (and when tp_size changes)."""
        if self.llm is not None and cfg.tp_size == self.tp_size:
            return self.llm
        self.llm = None  # free the engine of another tp size first
        self.gen_mesh = generation_mesh(self.train_mesh, cfg.tp_size, make_mesh)
        self.llm = build_engine(self.model.config, self.model_path, self.dtype, self.device, self.gen_mesh, cfg)
        self.tp_size = cfg.tp_size
        return self.llm

    def check_closed(self, action: str) -> None:
        """Refuse `action` (something that changes the training weights) while a rollout is open."""
        if self.open_rollout is not None:
            raise RuntimeError(f"{action} between begin_rollout and end_rollout: the engine would go on "
                               "sampling from the weights it loaded; call end_rollout first")

    @torch.no_grad()
    def begin(self, cfg: RolloutConfig) -> None:
        """Wake the engine (built for `cfg`'s engine settings) and load the actor's current
        weights into it."""
        if self.open_rollout is not None:
            raise RuntimeError("begin_rollout while a rollout is open: call end_rollout first")
        llm = self._engine(cfg)
        release_training_memory(self.model, self.device)
        llm.wake_up()
        fault_point("handoff")
        llm.load_weights(generation_weights(self.model, self.gen_mesh, self.dtype))
        self.open_rollout = cfg

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], cfg: RolloutConfig, with_greedy: bool = False) -> list[RequestOutput]:
        """Sample `cfg.n` responses for each of this rank's prompts with the weights begin()
        loaded (and, `with_greedy`, a greedy one after them), drawn as cfg's sampling fields
        say; the engine's settings stay begin()'s. Returns the engine's RequestOutputs, in
        prompt order."""
        if self.open_rollout is None:
            raise RuntimeError("sample without begin_rollout: the engine holds no weights; call "
                               "begin_rollout(rollout) first (or generate, which does all three)")
        if cfg.tp_size != self.open_rollout.tp_size:
            raise ValueError(f"sample with --rollout.tp-size {cfg.tp_size} in a rollout begun with "
                             f"{self.open_rollout.tp_size}")
        return sample_on(self.llm, self.gen_mesh, prompts, cfg, with_greedy,
                         show=cfg.progress and self.train_mesh.get_local_rank() == 0)

    @torch.no_grad()
    def push(self, receivers: list[int], bucket_bytes: int) -> dict[str, float]:
        """Broadcast the current weights (in the engine's dtype, LoRA merged) from the actor's
        first rank to a rollout group on `receivers` (hflow.distributed.weight_sync); every actor rank takes
        part in the gathers. Returns the seconds it took and the bytes sent."""
        began = time.perf_counter()
        ranks = self.train_mesh.mesh.flatten().tolist()
        source, me = ranks[0], dist.get_rank()
        if self.full_mesh is None:
            self.full_mesh = generation_mesh(self.train_mesh, 1, make_mesh)
        group = local_group(joint_ranks(source, receivers)) if me == source else None
        fault_point("handoff")
        sent = send_weights(generation_weights(self.model, self.full_mesh, self.dtype), weight_manifest(self.model),
                            group, source, bucket_bytes, is_source=me == source)
        return {"push_s": time.perf_counter() - began, "push_bytes": float(sent)}

    def agent_engine(self, cfg: RolloutConfig) -> LLM | EngineGroup:
        """The engine for a multi-turn rollout (workers/agent_rollout.py) on begin()'s weights: the
        LLM at tp_size 1; above, an EngineGroup (workers/lockstep_engine.py), since a tp group's
        engines must take the same requests in the same steps while each trajectory's tool calls
        answer when they answer: the group's leader runs the sessions, the others follow it."""
        if self.open_rollout is None:
            raise RuntimeError("sample_agent without begin_rollout: the engine holds no weights; call "
                               "begin_rollout(rollout) first (or generate_agent, which does all three)")
        if cfg.tp_size != self.open_rollout.tp_size:
            raise ValueError(f"sample_agent with --rollout.tp-size {cfg.tp_size} in a rollout begun with "
                             f"{self.open_rollout.tp_size}")
        fault_point("generate")
        return self.llm if cfg.tp_size == 1 else EngineGroup(self.llm, self.gen_mesh)

    def end(self) -> None:
        """Put the engine to sleep: free its KV cache, and its weights unless the rollout's
        config keeps them (free_weights_when_asleep)."""
        if self.open_rollout is None:
            raise RuntimeError("end_rollout without begin_rollout")
        self.llm.sleep(level=2 if self.open_rollout.free_weights_when_asleep else 1)
        self.open_rollout = None
        # what the engine freed would stay resident (glibc's heap, CUDA's cache) and the update
        # allocate beside it: Qwen3-0.6B's ranks on a 24 GiB host were OOM-killed at 12.4-12.8 GB
        # without this, and peak at 10.1 GiB with it (docs/performance.md, "At a real size")
        release_freed_memory(self.device)


def release_training_memory(model: torch.nn.Module, device: torch.device) -> None:
    """Give what the last update freed back to the system before the engine allocates: FSDP's
    kept communication buffers (cpu_collectives.ReusedBuffers) and the heap's free pages."""
    buffers = getattr(model, "reused_buffers", None)
    if buffers is not None:
        buffers.release()
    release_freed_memory(device)


def build_engine(config, model_path: str, dtype: torch.dtype, device: torch.device, gen_mesh: DeviceMesh,
                 cfg: RolloutConfig) -> LLM:
    """An engine with uninitialised weights for `config`, with `cfg`'s engine settings, tensor-
    parallel over the tp dim of `gen_mesh` (hflow.distributed.reshard.generation_mesh)."""
    options = {"max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
               "enable_prefix_caching": cfg.enable_prefix_caching, "gpu_memory_fraction": cfg.gpu_memory_fraction}
    if cfg.kv_cache_bytes:
        options["kv_cache_bytes"] = cfg.kv_cache_bytes
    if cfg.max_model_len:
        options["max_model_len"] = cfg.max_model_len
    if cfg.tp_size > 1:
        options["tp_group"] = gen_mesh.get_group("tp")
    return LLM(config, dtype=dtype, device=device, eos_token_ids=stop_token_ids(model_path), **options)


def sample_on(llm: LLM, gen_mesh: DeviceMesh, prompts: list[list[int]], cfg: RolloutConfig, with_greedy: bool,
              show: bool, between_steps=None) -> list[RequestOutput]:
    """`cfg.n` samples of each of this rank's prompts (and a greedy one `with_greedy`) from an
    engine tensor-parallel over gen_mesh's tp dim: the tp group pools its prompts, runs them
    together with the same seeds, and each rank keeps its own prompts' outputs. `between_steps`:
    LLM.generate's."""
    tp_group = gen_mesh.get_group("tp")
    pooled = [None] * cfg.tp_size
    if cfg.tp_size > 1:
        dist.all_gather_object(pooled, prompts, group=tp_group)
    else:
        pooled = [prompts]
    params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_tokens=cfg.max_tokens, seed=cfg.seed)
    requests = [p for part in pooled for p in part]
    fault_point("generate")
    if with_greedy:
        # a request of its own next to the samples': it shares the prompt's KV blocks through the
        # prefix cache, and the samples' seeded streams do not change
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_tokens, seed=cfg.seed)
        outputs = llm.generate([p for p in requests for _ in range(2)], [params, greedy] * len(requests),
                               use_tqdm=show, between_steps=between_steps)
        outputs = [_with_greedy(s, g) for s, g in zip(outputs[0::2], outputs[1::2])]
    else:
        outputs = llm.generate(requests, params, use_tqdm=show, between_steps=between_steps)
    mine = gen_mesh.get_local_rank("tp")
    start = sum(len(part) for part in pooled[:mine])
    return outputs[start:start + len(prompts)]


def _with_greedy(sampled: RequestOutput, greedy: RequestOutput) -> RequestOutput:
    """One prompt's samples, then its greedy completion as sample n."""
    last = replace(greedy.outputs[0], index=len(sampled.outputs))
    return RequestOutput(sampled.request_id, sampled.prompt_token_ids, [*sampled.outputs, last])

