"""A request's sample does not depend on which CPU rollout replica serves it (so not on the DP size).

verl runs one rollout replica per data-parallel group; a batch at DP 2 is served by two replicas.
Two real ``CPUServer`` replicas (ranks 0 and 1, the shipped ``cpu_tiny`` config) sample the same
tokens with the same log-probs for the same prompt and policy version. Twin: with the replica rank in
the engine seed (as before), replica 1 samples other tokens, and a DP 2 run collects another batch.
"""

import asyncio

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from true_on_policy import tiny_assets

CONFIGS = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20]]


@pytest.fixture(scope="module")
def replicas():
    from true_on_policy.transformers_adapter.forwards import patch_transformers

    patch_transformers()
    from true_on_policy.verl_adapter.cpu_rollout import CPUServer
    from verl.workers.rollout.replica import RolloutMode

    tiny_assets.ensure_assets()
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="cpu_tiny")
    OmegaConf.resolve(cfg)
    loop = asyncio.new_event_loop()  # the servers' asyncio state is bound to the loop that first runs them
    servers = [CPUServer(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, RolloutMode.COLOCATED, rank)
               for rank in (0, 1)]
    yield loop, servers
    pending = asyncio.all_tasks(loop)  # the servers' serving loops
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def _samples(replicas, index):
    loop, servers = replicas
    server = servers[index]

    async def run():
        outs = [await server.generate(p, {"temperature": 1.0, "max_tokens": 8}, f"r{i}") for i, p in enumerate(PROMPTS)]
        return [(o.token_ids, torch.tensor(o.log_probs)) for o in outs]

    return loop.run_until_complete(run())


def test_replicas_sample_the_same_tokens_and_log_probs(replicas):
    first, second = _samples(replicas, 0), _samples(replicas, 1)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(first, second):
        assert ids_a == ids_b and torch.equal(lp_a, lp_b)


def test_twin_the_replica_rank_in_the_seed_changes_the_samples(replicas):
    server = replicas[1][1]
    reference = _samples(replicas, 0)
    saved = server.engine.seed
    server.engine.seed = saved + server.replica_rank  # the seed as it was
    try:
        shifted = _samples(replicas, 1)
    finally:
        server.engine.seed = saved
    assert any(a[0] != b[0] for a, b in zip(reference, shifted))
