"""The phase manager's order of sleeps, wakes and weight syncs (the same code path as on a GPU)."""
import torch

from fastcredit.distributed.colocate import PhaseManager


class Engine:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def sleep(self, level):
        self.log.append(f"{self.name}.sleep({level})")

    def wake_up(self, tags):
        self.log.append(f"{self.name}.wake({tags})")


def test_phases_sleep_wake_and_sync_in_order():
    log = []
    pm = PhaseManager(Engine("policy", log), Engine("critic", log), device=torch.device("cpu"),
                      sync_fn=lambda model: log.append("sync"))
    with pm.rollout(weights=object()):
        pass
    with pm.judge():
        pass
    with pm.train():
        pass
    pm.mark_updated()
    with pm.rollout(weights=object()):
        pass
    assert log == ["critic.sleep(1)", "policy.sleep(2)", "critic.wake(None)", "critic.sleep(1)",
                   "policy.wake(['weights'])", "sync", "policy.wake(['kv_cache'])"]
    assert [b for b, _ in pm.history] == ["rollout:start", "rollout:end", "judge:start", "judge:end", "train:start",
                                         "train:end", "rollout:start", "rollout:end"]


def test_without_colocation_engines_stay_awake_but_weights_still_sync():
    log = []
    pm = PhaseManager(Engine("policy", log), None, colocate=False, sync_fn=lambda m: log.append("sync"))
    with pm.train():
        pass
    pm.mark_updated()
    with pm.rollout(weights=object()):
        pass
    assert log == ["sync"]
