"""verl's patched internals in a fresh Python and next to vLLM: the plugin arms the trainer-start check without
importing the trainer, and the vLLM weight-sync socket carries the launch's own name (the patch list and each
target's check: tests/unit/test_patches.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from true_on_policy import patching
from true_on_policy.config.settings import ENV_VAR, Settings
from true_on_policy.verl_adapter import patches

# Their modules import vLLM (seconds): the patch list with the others in tests/unit/test_patches.py.
VLLM_WEIGHT_SYNC_TARGETS = {
    "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter.__init__",
    "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._get_zmq_handle",
}


def _verl_0_9_1_address(job_id: str) -> str:
    """verl 0.9.1's weight-sync address of replica 0, rank 0 (vllm_rollout.py:141, utils.py:431)."""
    return f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-0-rank-0.sock"


@pytest.mark.subprocess
def test_the_plugin_arms_the_start_check_without_importing_the_trainer():
    code = (
        "import sys, verl\n"
        "assert 'verl.trainer.ppo.v1.trainer_base' not in sys.modules, 'imported at plugin load'\n"
        "from true_on_policy import patching\n"
        "from verl.trainer.ppo.v1.trainer_base import PPOTrainer\n"
        "assert patching.is_replacement(PPOTrainer.__init__)\n"
        "import verl.utils.device\n"
        "assert patching.is_replacement(verl.utils.device.auto_set_device)\n"
        "print('armed')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != ENV_VAR}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "armed" in result.stdout, result.stderr[-3000:]


@pytest.mark.subprocess
def test_a_launch_process_installs_the_trainer_and_engine_patches_when_their_modules_are_imported():
    """In every process of a launch (settings exported) the plugin activates, but verl's trainer module (and
    vLLM behind it) and its FSDP engine module (datasets, peft, pandas behind it) are imported only by the
    processes that run them: their patches are installed when they are imported, seconds of CPU saved in each
    of a launch's other Ray actors. Twin: importing the engine module is what brings in those libraries."""
    code = (
        "import sys, verl\n"
        "from true_on_policy import patching\n"
        "heavy = ('verl.trainer.ppo.v1.trainer_base', 'verl.workers.engine.fsdp.transformer_impl', 'datasets', 'vllm')\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
        "from verl.trainer.ppo.v1.trainer_base import PPOTrainer\n"
        "for name in ('_compute_advantage', '_compute_old_log_prob', '_balance_batch', '_save_checkpoint', '_load_checkpoint'):\n"
        "    assert patching.is_replacement(getattr(PPOTrainer, name)), name\n"
        "from verl.workers.engine.fsdp import transformer_impl\n"
        "assert 'datasets' in sys.modules\n"
        "assert patching.is_replacement(transformer_impl.logprobs_from_logits)\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "engine = EngineRegistry.get_engine_cls(model_type='language_model', backend='fsdp')\n"
        "assert engine is transformer_impl.FSDPEngineWithLMHead, engine\n"
        "print('installed on import')\n"
    )
    env = {**os.environ, ENV_VAR: Settings(platform="cpu").to_json(), "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "installed on import" in result.stdout, result.stderr[-3000:]


def _what_launch_a_receives(address_a: str, address_b: str) -> str:
    """Launch A's weight-sync sender binds, then launch B's (verl's own ``_init_socket``: remove the
    file, bind), and A's receiver connects to A's address: what it receives, from the sender it reached."""
    import torch
    import zmq
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver, BucketedWeightSender

    senders = {name: BucketedWeightSender(address, bucket_size_mb=1, use_shm=True)
               for name, address in (("A", address_a), ("B", address_b))}
    receiver = BucketedWeightReceiver(address_a, torch.device("cpu"), use_shm=True)
    try:
        for sender in senders.values():
            sender._init_socket()
        receiver._init_socket()
        reached = [name for name, sender in senders.items() if sender.socket.poll(3000, zmq.POLLOUT)]
        assert len(reached) == 1, reached  # the receiver is connected to exactly one sender
        senders[reached[0]].socket.send_pyobj(f"launch {reached[0]}'s weights")
        assert receiver.socket.poll(5000), "nothing arrived"
        return receiver.socket.recv_pyobj()
    finally:
        for socket in [receiver.socket] + [sender.socket for sender in senders.values()]:
            if socket is not None:
                socket.close(linger=0)
        for address in {address_a, address_b}:
            Path(address[len("ipc://"):]).unlink(missing_ok=True)


@pytest.mark.vllm
def test_two_launches_weight_syncs_reach_their_own_rollout(monkeypatch):
    """Two launches on one host whose syncs overlap: with verl 0.9.1's names (the Ray job id, 01000000 in
    both fresh clusters) launch A's rollout receives launch B's weights -- and A's sender is left with no
    peer, the hang seen under pytest-xdist; with the launch's own name in the path, its own."""
    job_id = f"test{os.getpid()}"  # one job id for both launches, as 01000000 is (and no clash with a real run)
    verl_address = _verl_0_9_1_address(job_id)
    assert _what_launch_a_receives(verl_address, verl_address) == "launch B's weights"  # the twin: the clash
    launch_addresses = []
    for _ in range(2):  # two launches: each exports its own name
        monkeypatch.setenv(patches.WEIGHT_SYNC_RUN_ENV, patches.weight_sync_run_env()[patches.WEIGHT_SYNC_RUN_ENV])
        launch_addresses.append(patches.launch_socket(verl_address))
    assert launch_addresses[0] != launch_addresses[1]
    assert all(address.endswith(f"-{job_id}-replica-0-rank-0.sock") for address in launch_addresses)
    assert _what_launch_a_receives(*launch_addresses) == "launch A's weights"


@pytest.mark.vllm
def test_the_weight_sync_patch_is_installed_on_verl_0_9_1s_sender_and_receiver(monkeypatch):
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    for target in sorted(VLLM_WEIGHT_SYNC_TARGETS):
        patches.check_target(target)
    # put verl's own back after the test (monkeypatch restores what it set)
    monkeypatch.setattr(ServerAdapter, "__init__", ServerAdapter.__init__)
    monkeypatch.setattr(vLLMColocateWorkerExtension, "_get_zmq_handle", vLLMColocateWorkerExtension._get_zmq_handle)
    verl_get_zmq_handle = patching.original_of(vLLMColocateWorkerExtension._get_zmq_handle)
    patches.install_launch_weight_sync_socket()
    patches.install_launch_weight_sync_socket()  # idempotent
    assert patching.is_replacement(ServerAdapter.__init__)
    assert patching.original_of(ServerAdapter.__init__) is not ServerAdapter.__init__
    assert vLLMColocateWorkerExtension._get_zmq_handle.__wrapped__ is verl_get_zmq_handle
    # the receiver's address, as a vLLM worker of this launch computes it
    worker = types.SimpleNamespace(local_rank=0, model_runner=None)
    monkeypatch.setenv("VERL_RAY_JOB_ID", "01000000")
    monkeypatch.setenv("VERL_REPLICA_RANK", "0")
    monkeypatch.setenv(patches.WEIGHT_SYNC_RUN_ENV, "123-abc")
    assert verl_get_zmq_handle(worker) == _verl_0_9_1_address("01000000")
    assert vLLMColocateWorkerExtension._get_zmq_handle(worker) == (
        "ipc:///tmp/rl-colocate-zmq-123-abc-01000000-replica-0-rank-0.sock")
